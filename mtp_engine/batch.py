"""Throughput mode: plain greedy decoding of many prompts at once.

Continuous batching is mlx-lm's own ``BatchGenerator`` (reused, not
rewritten): rows enter as others finish, up to ``batch_size`` in flight. No
speculation; results carry the same record type with mode "batch".
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Hashable

from mlx_lm.generate import BatchGenerator

from mtp_engine.stopping import Finisher, stop_list
from schemas.records import GenerationResult, GenerationStats


@dataclass
class _InFlight:
    key: Hashable
    prompt: list[int]
    finisher: Finisher
    started: float
    first_token_at: float | None = None


class BatchDecoder:
    """Decode many prompts with continuous batching.

    Args:
        engine: A loaded `MTPEngine` (its trunk and tokenizer are used).
        batch_size: Most sequences decoded together.
        prefill_batch_size: Most prompts prefilled together (default
            ``min(batch_size, 8)``).

    Use ``add`` to queue prompts and call ``step`` until ``pending`` is 0;
    each ``step`` returns the ``(key, result)`` pairs that finished.
    """

    def __init__(self, engine, batch_size: int = 8, prefill_batch_size: int | None = None):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        self.engine = engine
        self.batch_size = batch_size
        self._gen = BatchGenerator(
            engine.model,
            stop_tokens=[[t] for t in sorted(engine.eos_token_ids)],
            completion_batch_size=batch_size,
            prefill_batch_size=prefill_batch_size or min(batch_size, 8),
            prefill_step_size=engine.prefill_step_size,
        )
        self._in_flight: dict[int, _InFlight] = {}

    @property
    def pending(self) -> int:
        return len(self._in_flight)

    def add(
        self,
        key: Hashable,
        prompt: str | list[int],
        *,
        max_tokens: int = 256,
        stop: str | list[str] | None = None,
    ) -> None:
        """Queue a prompt. Raises the same errors as `MTPEngine.generate`."""
        engine = self.engine
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
        stops = stop_list(stop)
        ids = engine.check_prompt(engine.encode(prompt))
        max_tokens = min(max_tokens, engine.context_length - len(ids))
        finisher = Finisher(engine.tokenizer, engine.eos_token_ids, max_tokens, stops)
        (uid,) = self._gen.insert([ids], [max_tokens])
        self._in_flight[uid] = _InFlight(key, ids, finisher, time.perf_counter())

    def step(self) -> list[tuple[Hashable, GenerationResult]]:
        """Advance every sequence by one token; return those that finished."""
        if not self._in_flight:
            return []
        finished = []
        for response in self._gen.next_generated():
            row = self._in_flight.get(response.uid)
            if row is None:
                continue
            if row.first_token_at is None:
                row.first_token_at = time.perf_counter()
            row.finisher.add([response.token])
            if response.finish_reason is not None or row.finisher.done:
                if response.finish_reason is None:
                    self._gen.remove([response.uid])  # stopped on a stop string
                del self._in_flight[response.uid]
                finished.append((row.key, self._result(row)))
        return finished

    def drop_all(self) -> list[Hashable]:
        """Abandon every sequence in flight; return their keys."""
        uids = list(self._in_flight)
        if uids:
            self._gen.remove(uids)
        keys = [self._in_flight.pop(uid).key for uid in uids]
        return keys

    def close(self) -> None:
        self._gen.close()

    def _result(self, row: _InFlight) -> GenerationResult:
        now = time.perf_counter()
        first = row.first_token_at or now
        stats = GenerationStats(
            mode="batch",
            prompt_tokens=len(row.prompt),
            generated_tokens=len(row.finisher.tokens),
            prefill_s=first - row.started,
            decode_s=now - first,
        )
        return GenerationResult(
            tokens=row.finisher.tokens,
            text=row.finisher.text(),
            finish_reason=row.finisher.reason or "length",
            stats=stats,
            prompt_tokens=row.prompt,
        )

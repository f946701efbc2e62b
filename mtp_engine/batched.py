"""Batched speculative decoding: B rows x K drafts in one verify forward,
with continuous batching.

Up to ``batch_size`` rows are in flight. A row joins after its own prefill
(the single-sequence path: the engine's recurrence kernels, chunks of
``prefill_step_size`` tokens, so no graph grows with the batch) and leaves as
soon as it finishes (EOS, a stop string, its token budget); the next prompt
joins without stopping the others. Each step:

1. **Draft**: every row drafts K tokens from its pending pairs
   (`mtp_engine.drafters.batched`): ``[B, K]``.
2. **Verify**: one trunk forward over ``[B, K+1]`` (each row's last token
   and its drafts) that captures per-token recurrent states.
3. **Accept**: each row accepts its own prefix and emits it plus a bonus token.
4. **Commit**: attention caches keep each row's accepted inputs (the rest
   become holes no later query attends: `mtp_engine.cache.batch`);
   recurrent caches take, per row, the state after its last accepted input
   (one gather); the drafter queues each row's accepted pairs.

With ``draft_tokens=0`` (mode "baseline") a step is plain batched decoding:
one token per row. Every row's tokens equal plain decoding of its prompt
alone: rows never see each other's entries, and each row's state is the one
its own inputs give.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Hashable

import mlx.core as mx

from mtp_engine.cache.batch import (
    append_row,
    commit_rows,
    filter_rows,
    make_batch_cache,
)
from mtp_engine.cache.capture import StateCaptureCache, make_main_cache
from mtp_engine.drafters.batched import BatchedCppDrafter, BatchedMLXDrafter
from mtp_engine.projection import ProjectedDrafts
from mtp_engine.stopping import Finisher, stop_list
from mtp_engine.verify import accepted_prefix, greedy_tokens
from schemas.records import GenerationResult, GenerationStats

BATCH_MODES = ("baseline", "chain")


@dataclass
class _Row:
    key: Hashable
    prompt: list[int]
    finisher: Finisher
    stats: GenerationStats
    x: int  # the last emitted token, not yet fed to the trunk
    projection: ProjectedDrafts | None = None
    joined_at: float = field(default_factory=time.perf_counter)


@dataclass
class _Queued:
    key: Hashable
    prompt: list[int]
    max_tokens: int
    stop: list[str]
    projection: ProjectedDrafts | None


class BatchedDecoder:
    """Continuous batching of speculative (or plain) decoding.

    Args:
        engine: A loaded `MTPEngine`.
        batch_size: Most rows in flight.
        mode: "chain" (K drafts per row and step) or "baseline" (plain
            batched decoding).
        draft_tokens: K.
        drafter: "auto" (the C++ head where the engine has it, else the MLX
            head), "mlx", "cpp", or a batched drafter object
            (`mtp_engine.drafters.batched`).
        label: The mode the results' statistics name (default ``mode``).

    Use `add` to queue prompts and call `step` until `pending` is 0; each
    step returns the ``(key, result)`` pairs that finished.
    """

    def __init__(self, engine, batch_size: int = 8, mode: str = "chain", draft_tokens: int = 3,
                 drafter="auto", label: str | None = None):
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if mode not in BATCH_MODES:
            raise ValueError(f"batched decoding runs modes {', '.join(BATCH_MODES)}, got {mode!r}")
        if mode == "chain" and (not isinstance(draft_tokens, int) or not 1 <= draft_tokens <= 16):
            raise ValueError(f"draft_tokens must be an int in 1..16, got {draft_tokens!r}")
        self.engine = engine
        self.batch_size = batch_size
        self.mode = mode
        self.label = label or mode
        self.k = draft_tokens if mode == "chain" else 0
        self.drafter = self._make_drafter(drafter) if self.k else None
        self.caches = make_batch_cache(engine.model)
        self.rows: list[_Row] = []
        self.queue: list[_Queued] = []

    def _make_drafter(self, choice):
        if not isinstance(choice, str):
            return choice
        engine = self.engine
        cpp = engine.drafters.cpp
        if choice == "cpp":
            if cpp is None:
                raise ValueError("no C++ drafter: it drafts on the CPU backend when _mtp_cpp_drafter is built")
            return BatchedCppDrafter(cpp)
        if choice not in ("auto", "mlx"):
            raise ValueError(f"drafter must be 'auto', 'mlx' or 'cpp' for batched decoding, got {choice!r}")
        return BatchedMLXDrafter(engine.checkpoint.head, engine.model.model.embed_tokens, engine.lm_head,
                                 engine.prefill_step_size, compiled=engine.drafters.mlx.compiled)

    @property
    def pending(self) -> int:
        """Rows queued or in flight."""
        return len(self.rows) + len(self.queue)

    def add(self, key: Hashable, prompt: str | list[int], *, max_tokens: int = 256,
            stop: str | list[str] | None = None, projection: ProjectedDrafts | None = None) -> None:
        """Queue a prompt. Raises the errors of `MTPEngine.generate` for it.
        ``projection`` replaces its drafts at an acceptance profile
        (benchmarks of random-weight models, `mtp_engine.projection`)."""
        engine = self.engine
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
        stops = stop_list(stop)
        ids = engine.check_prompt(engine.encode(prompt))
        self.queue.append(_Queued(key, ids, min(max_tokens, engine.context_length - len(ids)), stops, projection))

    def drop_all(self) -> list[Hashable]:
        """Abandon every row queued or in flight; return their keys."""
        keys = [r.key for r in self.rows] + [q.key for q in self.queue]
        self._keep([])
        self.queue = []
        return keys

    def close(self) -> None:
        self.drop_all()

    # -- a step -------------------------------------------------------------

    def step(self) -> list[tuple[Hashable, GenerationResult]]:
        """Admit queued rows, then one draft-verify-commit step for every
        row in flight; return the rows that finished."""
        finished = self._admit()
        if not self.rows:
            return finished
        depth = min(self.k, max(r.finisher.remaining for r in self.rows) - 1)
        t0 = time.perf_counter()
        drafts = self.drafter.draft(depth) if depth > 0 else None  # [B, depth]
        if drafts is not None and any(r.projection is not None for r in self.rows):
            drafts = self._project(drafts)
        t1 = time.perf_counter()
        emitted, hidden = self._verify(drafts)
        t2 = time.perf_counter()
        done = []
        for b, (row, tokens) in enumerate(zip(self.rows, emitted)):
            s = row.stats
            s.steps += 1
            s.drafted += depth
            s.accepted += len(tokens) - 1
            s.draft_s += t1 - t0
            s.verify_s += t2 - t1
            if depth:
                s.histogram[len(tokens) - 1] += 1
            row.finisher.add(tokens)
            row.x = tokens[-1]
            if row.finisher.done:
                done.append(b)
        if depth:
            self.drafter.commit(hidden, emitted)
        if done:
            finished += [(self.rows[b].key, self._result(self.rows[b])) for b in done]
            self._keep([b for b in range(len(self.rows)) if b not in set(done)])
        return finished

    def _project(self, drafts: mx.array) -> mx.array:
        """Drafts replaced at the rows' acceptance profiles (the head's were
        computed: their cost is paid)."""
        rows = drafts.tolist()
        for b, row in enumerate(self.rows):
            if row.projection is not None:
                rows[b] = row.projection.replace(rows[b], len(row.finisher.tokens))
        return mx.array(rows, dtype=mx.int32)

    def _verify(self, drafts: mx.array | None) -> tuple[list[list[int]], mx.array]:
        """One trunk forward over every row's ``[x, drafts]``; commit each
        row's accepted prefix. Returns what each row emits and the hiddens."""
        x = mx.array([[r.x] for r in self.rows], dtype=mx.int32)  # [B, 1]
        inputs = x if drafts is None else mx.concatenate([x, drafts], axis=1)  # [B, K+1]
        width = inputs.shape[1]
        if width > 1:
            for c in self.caches:
                if isinstance(c, StateCaptureCache):
                    c.begin_capture()
        hidden = self.engine.model.model(inputs, cache=self.caches)  # [B, K+1, dim]
        targets = greedy_tokens(self.engine.lm_head(hidden)).astype(mx.int32)  # [B, K+1]
        read = (targets if drafts is None else mx.concatenate([drafts, targets], axis=1)).tolist()
        emitted = []
        for r in read:
            draft, target = r[: width - 1], r[width - 1 :]
            n = accepted_prefix(draft, target)
            emitted.append(draft[:n] + [target[n]])
        commit_rows(self.caches, width, [len(e) for e in emitted])
        return emitted, hidden

    # -- rows joining and leaving ---------------------------------------------

    def _admit(self) -> list[tuple[Hashable, GenerationResult]]:
        """Prefill queued prompts, one at a time, into free places."""
        finished = []
        while self.queue and len(self.rows) < self.batch_size:
            q = self.queue.pop(0)
            engine = self.engine
            stats = GenerationStats(mode=self.label, prompt_tokens=len(q.prompt),
                                    draft_tokens=self.k, paths=1)
            stats.histogram = [0] * (self.k + 1) if self.k else []
            finisher = Finisher(engine.tokenizer, engine.eos_token_ids, q.max_tokens, q.stop)
            t0 = time.perf_counter()
            caches = make_main_cache(engine.model)
            hidden, x = engine._prefill(q.prompt, caches, keep_hidden=self.k > 0)
            stats.prefill_s = time.perf_counter() - t0
            row = _Row(q.key, q.prompt, finisher, stats, x, q.projection)
            finisher.add([x])
            if finisher.done:
                finished.append((q.key, self._result(row)))
                continue
            append_row(self.caches, caches, len(self.rows))
            if self.drafter is not None:
                self.drafter.add_row(hidden, q.prompt[1:] + [x])
            self.rows.append(row)
        return finished

    def _keep(self, rows: list[int]) -> None:
        filter_rows(self.caches, rows)
        if self.drafter is not None and self.drafter.rows:
            self.drafter.filter(rows)
        self.rows = [self.rows[r] for r in rows]

    def _result(self, row: _Row) -> GenerationResult:
        s = row.stats
        s.decode_s = time.perf_counter() - row.joined_at
        s.generated_tokens = len(row.finisher.tokens)
        return GenerationResult(tokens=row.finisher.tokens, text=row.finisher.text(),
                                finish_reason=row.finisher.reason or "length", stats=s, prompt_tokens=row.prompt)

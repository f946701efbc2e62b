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
    BatchKVCache,
    append_row,
    commit_rows,
    filter_rows,
    make_batch_cache,
    replace_row,
    trim_leading,
)
from mtp_engine.cache.capture import StateCaptureCache, make_main_cache
from mtp_engine.drafters.batched import BatchedCppDrafter, BatchedMLXDrafter
from mtp_engine.options import MAX_DRAFT_TOKENS
from mtp_engine.projection import ProjectedDrafts, project_rows
from mtp_engine.sampling import GREEDY, SamplingParams, choose
from mtp_engine.stopping import Finisher, stop_list
from mtp_engine.verify import decide, decisions
from schemas.records import GenerationResult, GenerationStats

BATCH_MODES = ("baseline", "chain")

PHASES = ("prefill", "head_prefill", "join", "draft", "verify", "head_commit", "leave")
"""What `BatchedDecoder` can time: a joining row's trunk prefill, the head's
prefill over its prompt (the C++ drafter takes a prompt's pairs in its
first draft instead), adding it to the batch's caches; drafting; the verify
forward with acceptance and the trunk caches' commit; the head's commit;
dropping the rows that finished."""


@dataclass
class _Row:
    key: Hashable
    prompt: list[int]
    finisher: Finisher
    stats: GenerationStats
    x: int  # the last emitted token, not yet fed to the trunk
    sampling: SamplingParams = GREEDY
    projection: ProjectedDrafts | None = None
    joined_at: float = field(default_factory=time.perf_counter)


@dataclass
class _Queued:
    key: Hashable
    prompt: list[int]
    max_tokens: int
    stop: list[str]
    projection: ProjectedDrafts | None
    samples: list[SamplingParams] | None  # None: one row, greedy; else one row per sample
    prefilled: tuple | None = None  # (caches, hidden, logits) dispatched ahead of its turn, or None

    @property
    def params(self) -> list[SamplingParams]:
        """Each of its rows' sampling."""
        return self.samples or [GREEDY]


class BatchedDecoder:
    """Continuous batching of speculative (or plain) decoding.

    Args:
        engine: A loaded `MTPEngine`.
        batch_size: Most rows in flight.
        mode: "chain" (K drafts per row and step) or "baseline" (plain
            batched decoding).
        draft_tokens: K.
        drafter: "auto" (the C++ head where the engine has it, until the
            first sampled row; else the MLX head), "mlx", "cpp", or a
            batched drafter object (`mtp_engine.drafters.batched`).
        label: The mode the results' statistics name (default ``mode``).
        phase_seconds: A dict to add each phase's seconds to (see
            `PHASES`), or None (the default: nothing timed). Timing
            evaluates and synchronizes after every phase, so work that
            would overlap runs in turn: for finding where time goes, not
            for throughput.
        prefill_ahead: Each step first dispatches the prefill of the next
            N queued prompts on the engine's second stream (`MTPEngine.side_stream`),
            so a device that decoding leaves idle (host-bound steps)
            prefills while the batch drafts and verifies; a joining row
            then finds its caches ready. 0 (the default): each prompt
            prefills when it joins. The same computations either way, so
            the same tokens. Off while phases are timed.

    Use `add` to queue prompts and call `step` until `pending` is 0; each
    step returns the ``(key, result)`` pairs that finished.
    """

    def __init__(self, engine, batch_size: int = 8, mode: str = "chain", draft_tokens: int = 3,
                 drafter="auto", label: str | None = None, phase_seconds: dict | None = None,
                 prefill_ahead: int = 0):
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if mode not in BATCH_MODES:
            raise ValueError(f"batched decoding runs modes {', '.join(BATCH_MODES)}, got {mode!r}")
        if mode == "chain" and (not isinstance(draft_tokens, int) or not 1 <= draft_tokens <= MAX_DRAFT_TOKENS):
            raise ValueError(f"draft_tokens must be an int in 1..{MAX_DRAFT_TOKENS}, got {draft_tokens!r}")
        if not isinstance(prefill_ahead, int) or isinstance(prefill_ahead, bool) or prefill_ahead < 0:
            raise ValueError(f"prefill_ahead must be an int >= 0, got {prefill_ahead!r}")
        self.engine = engine
        self.batch_size = batch_size
        self.mode = mode
        self.label = label or mode
        self.k = draft_tokens if mode == "chain" else 0
        self.drafter = self._make_drafter(drafter) if self.k else None
        # "auto" drafts with the C++ head where there is one; it drafts
        # greedily, so the first sampled row switches to the MLX head (once
        # the rows in flight have finished: see `_may_join`).
        self._switch_for_sampling = drafter == "auto" and isinstance(self.drafter, BatchedCppDrafter)
        self.caches = make_batch_cache(engine.model)
        self.rows: list[_Row] = []
        self.queue: list[_Queued] = []
        self.single_keys: set = set()  # keys added with one SamplingParams (not a list): results keyed as given
        self.phase_seconds = phase_seconds
        self._lap_start = 0.0
        # Timed phases run in turn, so nothing is prefilled ahead of them.
        self.prefill_ahead = 0 if phase_seconds is not None else prefill_ahead

    def _make_drafter(self, choice):
        if not isinstance(choice, str):
            return choice
        engine = self.engine
        cpp = engine.drafters.cpp
        if choice == "cpp" or (choice == "auto" and cpp is not None):
            if cpp is None:
                raise ValueError("no C++ drafter: it drafts on the CPU backend when _mtp_cpp_drafter is built")
            return BatchedCppDrafter(cpp)
        if choice not in ("auto", "mlx"):
            raise ValueError(f"drafter must be 'auto', 'mlx' or 'cpp' for batched decoding, got {choice!r}")
        return BatchedMLXDrafter(engine.checkpoint.head, engine.model.model.embed_tokens, engine.lm_head,
                                 engine.prefill_step_size, compiled=engine.drafters.mlx.compiled)

    @property
    def pending(self) -> int:
        """Rows queued or in flight (a queued prompt counts its samples)."""
        return len(self.rows) + sum(len(q.params) for q in self.queue)

    def add(self, key: Hashable, prompt: str | list[int], *, max_tokens: int = 256,
            stop: str | list[str] | None = None, projection: ProjectedDrafts | None = None,
            sampling: SamplingParams | list[SamplingParams] | None = None) -> None:
        """Queue a prompt. Raises the errors of `MTPEngine.generate` for it.

        Args:
            sampling: One `SamplingParams` (one row), or a list of them: one
                row per sample, keyed ``(key, j)``, all sharing one prefill.
            projection: Replace its drafts at an acceptance profile
                (benchmarks of random-weight models, `mtp_engine.projection`).
        """
        engine = self.engine
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
        stops = stop_list(stop)
        ids = engine.check_prompt(engine.encode(prompt))
        samples = sampling if isinstance(sampling, list) else None
        if samples is None and sampling is not None:
            samples = [sampling]
            self.single_keys.add(key)
        if samples is not None:
            if not samples or not all(isinstance(p, SamplingParams) for p in samples):
                raise TypeError("sampling must be SamplingParams or a non-empty list of them")
            if (self.k and any(not p.greedy for p in samples) and isinstance(self.drafter, BatchedCppDrafter)
                    and not self._switch_for_sampling):
                raise ValueError("sampling drafts with the MLX head; the C++ drafter drafts greedily")
        self.queue.append(_Queued(key, ids, min(max_tokens, engine.context_length - len(ids)), stops, projection,
                                  samples))

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
        self._dispatch_prefills()
        depth = min(self.k, max(r.finisher.remaining for r in self.rows) - 1)
        self._lap(None)
        t0 = time.perf_counter()
        params = [r.sampling for r in self.rows]
        starts = [len(r.finisher.tokens) for r in self.rows]  # the generated position verify column 0 predicts
        drafts = self.drafter.draft(depth, params, starts) if depth > 0 else None  # [B, depth]
        if drafts is not None:  # dispatched by the drafter: the device drafts while the verify forward is built
            if any(r.projection is not None for r in self.rows):
                drafts = self._project(drafts)
            self._lap("draft", drafts)
        t1 = time.perf_counter()
        # A row near its budget uses only the drafts it can emit, as a
        # sequence of its own would draft (the rejection sampler's tokens
        # depend on how many drafts precede a position).
        uses = [min(depth, r.finisher.remaining - 1) for r in self.rows]
        emitted, hidden = self._verify(drafts, params, starts, uses)
        self._lap("verify", states=True)
        t2 = time.perf_counter()
        done = []
        for b, (row, tokens) in enumerate(zip(self.rows, emitted)):
            s = row.stats
            s.steps += 1
            s.drafted += uses[b]
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
            self._lap("head_commit")
        if done:
            finished += [(self.rows[b].key, self._result(self.rows[b])) for b in done]
            finished += self._refill(done)
        return finished

    def _lap(self, phase: str | None, *arrays, states: bool = False) -> None:
        """With `phase_seconds`: evaluate ``arrays`` (and with ``states`` the
        batch's caches), wait for the device and charge the time since the
        last lap to ``phase`` (None: start)."""
        if self.phase_seconds is None:
            return
        mx.eval(*arrays, [c.state for c in self.caches] if states else [])
        mx.synchronize()
        now = time.perf_counter()
        if phase is not None:
            self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + now - self._lap_start
        self._lap_start = now

    def _project(self, drafts: mx.array) -> mx.array:
        """Drafts replaced at the rows' acceptance profiles. The head's stay
        in the graph (their cost is paid) but are not read back, as a real
        run reads none."""
        k = drafts.shape[1]
        return project_rows(drafts, [None if r.projection is None else r.projection.drafts(k, len(r.finisher.tokens))
                                     for r in self.rows])

    def _verify(self, drafts: mx.array | None, params: list[SamplingParams], starts: list[int],
                uses: list[int]) -> tuple[list[list[int]], mx.array]:
        """One trunk forward over every row's ``[x, drafts]``; commit each
        row's accepted prefix. Returns what each row emits and the hiddens."""
        x = mx.array([[r.x] for r in self.rows], dtype=mx.int32)  # [B, 1]
        if drafts is None:
            drafts = mx.zeros((len(self.rows), 0), dtype=mx.int32)
        inputs = mx.concatenate([x, drafts], axis=1)  # [B, K+1]
        width = inputs.shape[1]
        if width > 1:
            for c in self.caches:
                if isinstance(c, StateCaptureCache):
                    c.begin_capture()
        hidden = self.engine.model.model(inputs, cache=self.caches)  # [B, K+1, dim]
        logits = self.engine.lm_head(hidden)  # [B, K+1, V]
        q_scaled = self.drafter.q_scaled if self.drafter is not None and width > 1 else None
        rejecting = [p.sampler == "rejection" and not p.greedy for p in params] if q_scaled is not None else []
        lazy = []
        if not rejecting or not all(rejecting):  # rows whose drafts match targets (greedy, exact sampler)
            lazy.append(decisions(drafts, logits, params, starts))
        if any(rejecting):
            lazy.append(decisions(drafts, logits, params, starts, q_scaled))
        mx.eval(*lazy)  # one sync for everything the host reads
        reads = [a.tolist() for a in lazy]
        emitted = []
        for b in range(len(self.rows)):
            rejection = bool(rejecting) and rejecting[b]
            _, out = decide(reads[-1 if rejection else 0][b], width - 1, rejection, uses[b])
            emitted.append(out)
        commit_rows(self.caches, width, [len(e) for e in emitted])
        return emitted, hidden

    # -- rows joining and leaving ---------------------------------------------

    def _admit(self) -> list[tuple[Hashable, GenerationResult]]:
        """Prefill queued prompts, one at a time, into free places (a prompt
        with n samples needs n places, or an empty batch)."""
        finished = []
        while self.queue and self._may_join(self.queue[0]):
            if self.rows and len(self.rows) + len(self.queue[0].params) > self.batch_size:
                break
            finished += self._join(self.queue.pop(0), [])
        return finished

    def _dispatch_prefills(self) -> None:
        """Dispatch the prefill of the next `prefill_ahead` queued prompts on
        a stream of their own, so it runs while this step drafts and
        verifies; `_join` then finds it done (or waits for it)."""
        for q in self.queue[: self.prefill_ahead]:
            if q.prefilled is None:
                q.prefilled = self._prefill(q, self.engine.side_stream())

    def _prefill(self, q: _Queued, stream: mx.Stream | None = None) -> tuple:
        """``q``'s prompt through the trunk into fresh caches (with its
        hiddens when the head drafts): ``(caches, hidden, logits)``, on
        ``stream`` only dispatched (`MTPEngine.prefill`)."""
        caches = make_main_cache(self.engine.model)
        hidden, logits = self.engine.prefill(q.prompt, caches, keep_hidden=self.k > 0, stream=stream)
        return caches, hidden, logits

    def _may_join(self, q: _Queued) -> bool:
        """Whether ``q`` can join now: a sampled prompt waits for an empty
        batch if "auto" chose the C++ head (greedy only), which then gives
        way to the MLX head."""
        if not self._switch_for_sampling or all(p.greedy for p in q.params):
            return True
        if self.rows:
            return False
        self.drafter = self._make_drafter("mlx")
        self._switch_for_sampling = False
        return True

    def _refill(self, done: list[int]) -> list[tuple[Hashable, GenerationResult]]:
        """The rows ``done`` leave: queued prompts take their places while
        they fit (each joining row writes only its own slice of the
        batch's caches), the places left over are dropped."""
        free = list(done)
        finished = []
        while (free and self.queue and len(self.queue[0].params) <= len(free)
               and self._may_join(self.queue[0])):
            finished += self._join(self.queue.pop(0), free)
        if len(free) < len(done):
            self._lap(None)
            trim_leading(self.caches, BatchKVCache.step)  # entries only rows that left attended
            self._lap("join", states=True)
        if free:
            self._keep([b for b in range(len(self.rows)) if b not in set(free)])
            self._lap("leave", states=True)
        return finished

    def _join(self, q: _Queued, free: list[int]) -> list[tuple[Hashable, GenerationResult]]:
        """Prefill one queued prompt; each of its rows takes a place from
        ``free`` (popped) or joins at the end. Returns rows that finished
        with their first token."""
        finished = []
        samples = q.params
        engine = self.engine
        self._lap(None)
        t0 = time.perf_counter()
        caches, hidden, logits = q.prefilled or self._prefill(q)
        q.prefilled = None
        self._lap("prefill")
        prefill_s = (time.perf_counter() - t0) / len(samples)
        firsts = choose(mx.concatenate([logits] * len(samples)), samples,
                        mx.zeros((len(samples), 1), dtype=mx.int32)).tolist()  # generated position 0
        for j, (params, (x,)) in enumerate(zip(samples, firsts)):
            key = q.key if q.samples is None or q.key in self.single_keys else (q.key, j)
            stats = GenerationStats(mode=self.label, prompt_tokens=len(q.prompt), draft_tokens=self.k, paths=1,
                                    temperature=params.temperature,
                                    seed=None if params.greedy else params.seed, prefill_s=prefill_s)
            stats.histogram = [0] * (self.k + 1) if self.k else []
            finisher = Finisher(engine.tokenizer, engine.eos_token_ids, q.max_tokens, q.stop)
            row = _Row(key, q.prompt, finisher, stats, x, params, q.projection)
            finisher.add([x])
            if finisher.done:
                finished.append((key, self._result(row)))
                continue
            pairs = q.prompt[1:] + [x]
            if free:
                slot = free.pop(0)
                replace_row(self.caches, caches, slot)
                self.rows[slot] = row
            else:
                slot = len(self.rows)
                append_row(self.caches, caches, slot)
                self.rows.append(row)
            self._lap("join", states=True)
            if self.drafter is not None:
                if slot < self.drafter.rows:
                    self.drafter.replace_row(slot, hidden, pairs)
                else:
                    self.drafter.add_row(hidden, pairs)
                self._lap("head_prefill")
        self.single_keys.discard(q.key)
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

"""The decoder: continuous batching of rows that decode plainly or speculate
together (every `MTPEngine` call and the job runner decode through it).

Up to ``batch_size`` rows are in flight. A prompt joins after its prefill
(batch-of-one caches, copied into the batch's: one row per sample). A row's
result is returned as soon as it finishes; its place stays, a *ghost* that
steps on unread, until the next prompt takes it or the live rows fit a
smaller bucket of `buckets`, so the steps' shapes come from a small set
(`warm_up` meets them all). Each step:

1. **Draft**: the drafter (`mtp_engine.drafters`) proposes each row's paths,
   at most K deep, a row near its budget using only the drafts it can emit.
2. **Verify**: one trunk forward over every path's ``[x, drafts]``
   (`mtp_engine.verify`).
3. **Accept and commit**: each row keeps its best path's accepted prefix plus
   a bonus token in its caches (`mtp_engine.cache.batch`); the drafter
   queues each row's accepted pairs.

In mode "baseline" a step is plain decoding, one token per row, pipelined as
mlx-lm's ``generate_step``: the next forward is dispatched before this
step's tokens are read back. In mode "auto" the controller
(`mtp_engine.controller`) chooses before every step how many drafts it
verifies, 0 making it such a plain step; once it settles on plain steps
(drafts could not pay on this machine) the head stops following the rows
and the decoder runs as plain batching. Every row's tokens equal plain
decoding of its prompt alone: rows never see each other's entries.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Hashable

import mlx.core as mx

from mtp_engine.cache.batch import BatchKVCache, append_row, filter_rows, make_batch_cache, replace_row, trim_leading
from mtp_engine.cache.capture import make_main_cache
from mtp_engine.constraints import Constraint, RowGrammar, constrain, masks_of
from mtp_engine.controller import Controller, RowAcceptance, row_buckets
from mtp_engine.modes import CHAINS, DecodeConfig, cannot_draft, serves
from mtp_engine.prefix import PrefixState, copy_caches
from mtp_engine.sampling import SamplingParams, apply_penalties, check_logprobs, choose, token_logprobs, top_logits
from mtp_engine.stopping import Finisher, check_max_tokens, stop_list
from mtp_engine.verify import verify
from mtp_engine.warmup import warm_up
from schemas.records import GenerationResult, GenerationStats, StepTrace

class Hooks:
    """Where a benchmark may look inside a step (the decoder calls these;
    they do nothing here). ``lap(phase, *arrays, states=...)`` ends a phase:
    "prefill", "head_prefill", "join", "draft", "verify", "head_commit",
    "leave" (`mtp_engine.tools.phases` times them)."""

    def lap(self, phase: str | None, *arrays, states: list | None = None) -> None:
        pass


@dataclass
class _Row:
    key: Hashable
    prompt: list[int]
    finisher: Finisher
    stats: GenerationStats
    x: int  # the last emitted token, not yet fed to the trunk
    sampling: SamplingParams
    trace: list[StepTrace] | None = None
    joined_at: float = field(default_factory=time.perf_counter)
    acceptance: RowAcceptance | None = None
    ghost: bool = False  # finished: a place kept until a joining row takes it (`Decoder._compact`)
    logprobs: int | None = None  # alternatives per token, when its log-probabilities are asked for
    lp: list = field(default_factory=list)  # each emitted token's (logprob, alternatives)
    grammar: RowGrammar | None = None  # a constrained row's grammar state (dropped when it finishes)

    @property
    def budget(self) -> int:
        """Tokens it may still emit (none once it is a ghost)."""
        return 0 if self.ghost else self.finisher.remaining


@dataclass
class _Queued:
    key: Hashable
    prompt: list[int]
    max_tokens: int
    stop: list[str]
    samples: list[SamplingParams]
    trace: bool
    prefix: PrefixState | None = None
    logprobs: int | None = None
    constraint: Constraint | None = None


class Decoder:
    """Continuous batching of speculative (or plain) decoding.

    Args:
        engine: A loaded `MTPEngine`.
        decode: The mode, K, batch size and drafter (`DecodeConfig`).
        hooks: `Hooks` to call at each phase (benchmarks), or None.
        drafter: A drafter object to use instead of the one ``decode``
            names (benchmarks wrap one: `mtp_engine.tools.projection`).
        buckets: Whether finished rows keep their places down to a bucket
            of rows: True for `row_buckets`, or the row counts. Default:
            on a GPU only (`row_buckets` says why).

    Use `add` to queue prompts and call `step` until `pending` is 0; each
    step returns the ``((key, sample), result)`` pairs that finished.
    """

    def __init__(self, engine, decode: DecodeConfig, hooks: Hooks | None = None, drafter=None,
                 buckets: bool | list[int] | None = None):
        self.engine = engine
        self.decode = decode
        self.k = decode.draft_tokens if decode.speculative else 0
        self.hooks = hooks or Hooks()
        self.drafter = drafter
        self._own_drafter = drafter is None
        self.caches = make_batch_cache(engine.model)
        self.rows: list[_Row] = []
        self.queue: list[_Queued] = []
        self.controller = Controller(self.k) if decode.mode == "auto" else None
        self._ahead: mx.array | None = None  # plain steps: each fed row's next token, [R, 1], dispatched
        self._ahead_hidden: mx.array | None = None  # and the trunk's hiddens that chose it (mode "auto")
        self._ahead_logits: mx.array | None = None  # and its logits, while a row records a trace
        self._fed: list[bool] = []
        self._plain_steps = 0
        self._ended: float | None = None  # when the last step ended (mode "auto": step costs)
        size = decode.batch_size
        if buckets is None:
            buckets = mx.default_device() == mx.gpu
        if buckets is True:
            buckets = row_buckets(size)
        self.buckets = sorted({n for n in buckets if n < size} | {size}) if buckets else list(range(1, size + 1))

    @property
    def pending(self) -> int:
        """Rows queued or in flight (a queued prompt counts its samples)."""
        return self.live + sum(len(q.samples) for q in self.queue)

    @property
    def live(self) -> int:
        """Rows in flight (not counting ghosts)."""
        return sum(not r.ghost for r in self.rows)

    def add(self, key: Hashable, prompt: str | list[int], samples: list[SamplingParams], *, max_tokens: int = 256,
            stop: str | list[str] | None = None, trace: bool = False, prefix: PrefixState | None = None,
            logprobs: int | None = None, constraint: Constraint | None = None) -> None:
        """Queue a prompt: one row per sample, keyed ``(key, j)``, all
        sharing one prefill (of the tokens after ``prefix``, a
        `mtp_engine.prefix.PrefixState` the prompt continues, where given);
        ``logprobs=N`` records each token's log-probability and N
        alternatives; ``constraint`` makes each row's output match it.
        Raises the errors of `MTPEngine.generate`, and
        `mtp_engine.constraints.ConstraintError` for a constraint that does
        not compile."""
        check_max_tokens(max_tokens)
        if not samples or not all(isinstance(p, SamplingParams) for p in samples):
            raise TypeError("samples must be a non-empty list of SamplingParams")
        mode = self.decode.mode
        if self.k and mode not in CHAINS and any(p.rejects for p in samples):
            raise ValueError(f"the rejection sampler drafts chains; mode {mode!r} needs sampler='exact'")
        stops = stop_list(stop)
        engine = self.engine
        ids = engine.check_prompt(engine.encode(prompt))
        if constraint is not None:
            if not isinstance(constraint, Constraint):
                raise TypeError(f"constraint must be a Constraint, got {type(constraint).__name__}")
            engine.grammars.check(constraint)
        greedy, masked = all(p.greedy for p in samples), constraint is not None  # what a drafter must serve
        if self.k and self._own_drafter:  # a drafter that cannot draft these rows is named now
            engine.pick_drafter(mode, self.decode.drafter, greedy, masked)
        elif self.k and not serves(self.drafter.name, greedy, masked):
            raise cannot_draft(self.drafter.name)
        check_logprobs(logprobs)
        if prefix is not None and not prefix.continues(ids):
            raise ValueError(f"the prompt ({len(ids)} tokens) does not start with the prefix's {len(prefix)} tokens "
                             "and go on past them")
        self.queue.append(_Queued(key, ids, min(max_tokens, engine.context_length - len(ids)), stops,
                                  list(samples), trace, prefix, logprobs, constraint))

    def warm_up(self, sampling: SamplingParams) -> tuple[float, int, int]:
        """Meet every step shape before the first row (`mtp_engine.warmup`)."""
        return warm_up(self, sampling)

    def close(self) -> list[Hashable]:
        """Abandon every row queued or in flight; return their keys."""
        keys = [r.key for r in self.rows if not r.ghost] + [q.key for q in self.queue]
        self._keep([])
        self.queue = []
        return keys

    # -- a step ---------------------------------------------------------------

    def step(self, depth: int | None = None) -> list[tuple[Hashable, GenerationResult]]:
        """Admit queued rows, then one step for every row in flight; return
        the rows that finished. ``depth`` forces the step's drafts (0: a
        plain step; `warm_up` uses it); by default the mode decides."""
        entered = time.perf_counter()
        finished = self._admit()
        self._compact()
        if not self.rows:
            self._ended = None
            return finished
        joining = time.perf_counter() - entered  # admission is not the step's cost
        if depth is None and self.controller is not None:
            live = [r for r in self.rows if not r.ghost]
            depth = self.controller.choose([r.acceptance for r in live], [r.budget for r in live], len(self.rows))
            if self._head_off and self.drafter is not None:
                self._drop_head()
        elif depth is None:
            depth = self.k
        if depth:  # no more drafts than any row may still use
            depth = min(depth, max(r.budget for r in self.rows) - 1)
        rows = len(self.rows)
        done = self._plain_step() if depth == 0 else self._flush() or self._speculative_step(depth)
        if self.controller is not None:  # its cost: the wall time since the last step ended, all of it
            ended = time.perf_counter()
            if self._ended is not None:
                self.controller.observe_step(rows, depth + 1, ended - self._ended - joining)
            self._ended = ended
        for b in done:
            finished.append((self.rows[b].key, self._result(self.rows[b])))
            self.rows[b].ghost = True
            self.rows[b].grammar = None
        return finished

    def _speculative_step(self, depth: int) -> list[int]:
        """One step of ``depth`` >= 1 drafts (fewer for a row near its
        budget): draft, verify, commit; return the rows that finished."""
        rows = self.rows
        params = [r.sampling for r in rows]
        starts = [len(r.finisher.tokens) for r in rows]  # the generated position verify column 0 predicts
        caps = [max(0, min(depth, r.budget - 1)) for r in rows]
        grammars = [r.grammar for r in rows]
        masked = {"grammars": grammars} if any(g is not None for g in grammars) else {}
        self.hooks.lap(None)
        t0 = time.perf_counter()
        proposal = self.drafter.propose(self.decode, depth, params, starts, caps, **masked)
        self.hooks.lap("draft", proposal.tokens)
        t1 = time.perf_counter()
        xs = mx.array([[r.x] for r in rows], dtype=mx.int32)
        histories = [r.finisher.tokens for r in rows] if any(p.penalized for p in params) else None
        v = verify(self.engine.model.model, self.engine.lm_head, self.caches, xs, proposal, params, starts, histories)
        self.hooks.lap("verify", states=self.caches)
        t2 = time.perf_counter()
        paths_of: list[list[int]] = [[] for _ in rows]  # each row's verify rows (its paths, in order)
        for i, o in enumerate(proposal.owners if proposal.owners is not None else range(len(rows))):
            paths_of[o].append(i)
        done = []
        for b, (row, tokens) in enumerate(zip(rows, v.emitted)):
            row.x = tokens[-1]
            if row.ghost:
                continue
            w = v.winners[b]
            mine = paths_of[b]
            row.stats.count_step(len(v.paths[w]), v.accepted[w], mine.index(w), t1 - t0, t2 - t1)
            if row.trace is not None:
                row.trace.append(StepTrace([v.paths[i] for i in mine], v.accepted[w], mine.index(w), tokens,
                                           top_logits(v.logits[w, : len(tokens)])))
            self._emit(row, tokens)
            if row.finisher.done:
                done.append(b)
        # log-probabilities from the verify forward's logits at the winning path's positions
        self._record_logprobs([b for b, r in enumerate(rows) if r.logprobs is not None and not r.ghost],
                              lambda want: v.logits[mx.array([v.winners[b] for b in want], dtype=mx.int32)],
                              v.emitted)
        self.drafter.commit(v.hidden, v.emitted, v.winners)
        self.hooks.lap("head_commit")
        if self.controller is not None:
            live = [b for b, r in enumerate(rows) if not r.ghost]
            self.controller.observe_rows([rows[b].acceptance for b in live], [len(v.paths[v.winners[b]]) for b in live],
                                         [v.accepted[v.winners[b]] for b in live])
        return done

    def _plain_step(self) -> list[int]:
        """One plain forward for every row, dispatched before the last
        step's tokens are read (each fed row's ``_ahead`` token)."""
        rows = self.rows
        grammars = [r.grammar for r in rows]
        constrained = any(g is not None for g in grammars)
        host = mx.array([[r.x] for r in rows], dtype=mx.int32)
        xs = host if self._ahead is None else mx.where(mx.array(self._fed)[:, None], self._ahead, host)
        positions = mx.array([[len(r.finisher.tokens) + fed] for r, fed in zip(rows, self._fed)], dtype=mx.int32)
        if self.controller is None or self.drafter is None:
            hidden, logits = None, self.engine.model(xs, cache=self.caches)[:, -1:, :]
        else:  # the head consumes the pairs (hidden, token) at its next draft
            hidden = self.engine.model.model(xs, cache=self.caches)
            logits = self.engine.lm_head(hidden)
        params = [r.sampling for r in rows]
        if any(p.penalized for p in params):  # each row's history: its tokens, and the one not read back yet
            logits = apply_penalties(logits, params, [r.finisher.tokens for r in rows], pending=self._ahead,
                                     fed=self._fed)
        if constrained:  # the masks need the last step's tokens: read them while this forward computes
            mx.async_eval(logits)
            done = self._read_ahead()
            logits = constrain(logits, masks_of(grammars))
        ahead = choose(logits, params, positions)  # [R, 1]
        mx.async_eval(ahead)
        self.hooks.lap("verify", ahead)
        if not constrained:
            done = self._read_ahead()
        self._ahead, self._ahead_hidden, self._fed = ahead, hidden, [True] * len(rows)
        self._ahead_logits = logits if any(r.trace is not None or r.logprobs is not None for r in rows) else None
        self._plain_steps += 1
        if self._plain_steps % 256 == 0:
            mx.clear_cache()
        return done

    def _read_ahead(self) -> list[int]:
        """Emit the tokens of the dispatched plain step; return the rows
        that finished."""
        rows = self.rows
        if self._ahead is None or not any(self._fed):
            return []
        done = []
        tokens = self._ahead.tolist()
        for b, row in enumerate(rows):
            if self._fed[b]:
                row.x = tokens[b][0]
                if row.ghost:
                    continue
                row.stats.count_step(0, 0)
                if row.trace is not None and self._ahead_logits is not None:
                    row.trace.append(StepTrace([[]], 0, 0, tokens[b], top_logits(self._ahead_logits[b])))
                self._emit(row, tokens[b])
                if row.finisher.done:
                    done.append(b)
        if self._ahead_logits is not None:
            self._record_logprobs([b for b, r in enumerate(rows) if self._fed[b] and r.logprobs is not None
                                   and not r.ghost],
                                  lambda want: self._ahead_logits[mx.array(want, dtype=mx.int32)], tokens)
        if self._ahead_hidden is not None:
            self.drafter.extend(self._ahead_hidden, [tokens[b] if fed else [] for b, fed in enumerate(self._fed)])
        return done

    def _emit(self, row: _Row, tokens: list[int]) -> None:
        """Hand a row's emitted tokens to its finisher and its grammar (a
        grammar that takes no more tokens ends the row: finish reason "stop")."""
        row.finisher.add(tokens)
        if row.grammar is not None and row.grammar.commit(tokens) and not row.finisher.done:
            row.finisher.reason = "stop"

    def _record_logprobs(self, want: list[int], logits_of, tokens: list[list[int]]) -> None:
        """Append to each row ``b`` of ``want`` its ``tokens[b]``'s
        log-probabilities (`token_logprobs`) from ``logits_of(want)``."""
        if not want:
            return
        rows = self.rows
        for b, entries in zip(want, token_logprobs(logits_of(want), [rows[b].sampling for b in want],
                                                   [tokens[b] for b in want], [rows[b].logprobs for b in want])):
            rows[b].lp += entries

    def _flush(self) -> list[int]:
        """Before a speculative step: emit the dispatched plain step's
        tokens (each row's last token is then unfed again)."""
        done = self._read_ahead()
        self._ahead = self._ahead_hidden = self._ahead_logits = None
        self._fed = [False] * len(self.rows)
        return done

    # -- rows joining and leaving ---------------------------------------------

    def _ready_for(self, q: _Queued, joining: bool = False) -> bool:
        """Whether rows of ``q`` can join now (``joining``: behind prompts in prefill). The drafter
        is made for the first rows; "auto" drafts unconstrained greedy rows with the C++ head, unconstrained
        rows with the CUDA kernel, where there is one, so the first rows it does not serve wait for an empty
        batch, which then drafts with the MLX head."""
        if not self.k or self._head_off:
            return True
        greedy, masked = all(p.greedy for p in q.samples), q.constraint is not None
        if self.drafter is not None and serves(self.drafter.name, greedy, masked):
            return True
        if self.live or joining or not self._own_drafter:
            return False
        self._keep([])
        engine = self.engine
        self.drafter = engine.make_drafter(engine.pick_drafter(self.decode.mode, self.decode.drafter, greedy, masked))
        return True

    def _admit(self) -> list[tuple[Hashable, GenerationResult]]:
        """Prefill queued prompts while the live rows and the prompts' samples fit the batch (a prompt
        with n samples needs n places, or an empty batch), each dispatched while the host builds the
        next, their first tokens read in one sync; rows ending there leave their places."""
        finished = []
        replaced = False
        while True:
            joining, places, t0 = [], self.live, time.perf_counter()
            while self.queue and self._ready_for(self.queue[0], joining=bool(joining)):
                if places and places + len(self.queue[0].samples) > self.decode.batch_size:
                    break
                places += len(self.queue[0].samples)
                joining.append(self._prefill(self.queue.pop(0)))
            if not joining:
                break
            self.hooks.lap(None)
            mx.eval([j[-1] for j in joining] + [j[2] for j in joining if j[2] is not None])
            self.hooks.lap("prefill")
            prefill_s = (time.perf_counter() - t0) / len(joining)  # each prompt's share
            for j in joining:
                free = [b for b, r in enumerate(self.rows) if r.ghost]
                replaced |= bool(free)
                finished += self._join(*j[:-1], j[-1].tolist(), free, prefill_s / len(j[0].samples))
        if replaced:
            self.hooks.lap(None)
            trim_leading(self.caches, BatchKVCache.step)  # entries only rows that left attended
            self.hooks.lap("join", states=self.caches)
        return finished

    def _compact(self) -> None:
        """Drop ghosts down to the smallest of `buckets` holding the live rows (`row_buckets` says why)."""
        live = [b for b, r in enumerate(self.rows) if not r.ghost]
        size = min((n for n in self.buckets if n >= len(live)), default=len(live)) if live else 0
        if len(self.rows) > size:
            ghosts = [b for b, r in enumerate(self.rows) if r.ghost][: size - len(live)]
            self._keep(sorted(live + ghosts))
            self.hooks.lap("leave", states=self.caches)

    def _prefill(self, q: _Queued) -> tuple:
        """Dispatch one queued prompt's prefill and first tokens (read by
        `_admit`): ``(q, caches, hidden, logits, grammars, first tokens)``."""
        engine = self.engine
        self.hooks.lap(None)
        start = 0 if q.prefix is None else len(q.prefix)  # the prefix's caches, copied, then the row's own tokens
        caches = make_main_cache(engine.model) if q.prefix is None else copy_caches(q.prefix.caches)
        hidden, logits = engine.prefill(q.prompt[start:], caches, keep_hidden=self.drafter is not None,
                                        evaluate=False)  # the first tokens' read-back is its one sync
        if q.prefix is not None and self.drafter is not None:
            hidden = mx.concatenate([q.prefix.hidden, hidden], axis=1)
        logits = mx.concatenate([logits] * len(q.samples))
        grammars = [engine.grammars.row(q.constraint) for _ in q.samples] if q.constraint is not None else None
        if grammars is not None:
            logits = constrain(logits, masks_of(grammars))
        firsts = choose(logits, q.samples, mx.zeros((len(q.samples), 1), dtype=mx.int32))  # position 0
        mx.async_eval(firsts, hidden if hidden is not None else [])
        self.hooks.lap("prefill")
        return q, caches, hidden, logits, grammars, firsts

    def _join(self, q: _Queued, caches: list, hidden: mx.array | None, logits: mx.array, grammars, firsts: list,
              free: list[int], prefill_s: float) -> list[tuple[Hashable, GenerationResult]]:
        """Place a prefilled prompt's rows: each takes a place from ``free``
        (popped) or joins at the end. Returns rows that finished with their
        first token."""
        engine = self.engine
        self.hooks.lap(None)
        finished = []
        for j, (params, (x,)) in enumerate(zip(q.samples, firsts)):
            key = (q.key, j)
            stats = self.decode.start_stats(params, len(q.prompt), prefill_s)
            finisher = Finisher(engine.tokenizer, engine.eos_token_ids, q.max_tokens, q.stop)
            row = _Row(key, q.prompt, finisher, stats, x, params, [] if q.trace else None,
                       acceptance=RowAcceptance.empty(self.k) if self.controller is not None else None,
                       logprobs=q.logprobs, grammar=grammars[j] if grammars is not None else None)
            if q.logprobs is not None:  # the first token, from the prefill's logits
                row.lp = token_logprobs(logits[j : j + 1], [params], [[x]], [q.logprobs])[0]
            self._emit(row, [x])
            if finisher.done:
                finished.append((key, self._result(row)))
                continue
            if free:
                slot = free.pop(0)
                replace_row(self.caches, caches, slot)
                self.rows[slot] = row
                self._fed[slot] = False
            else:
                slot = None
                append_row(self.caches, caches, len(self.rows))
                self.rows.append(row)
                self._fed.append(False)
                self._map_ahead(lambda a: mx.concatenate([a, a[:1]]))  # a place, unread (not fed)
            self.hooks.lap("join", states=self.caches)
            if self.drafter is not None:
                self.drafter.add_row(slot, hidden, q.prompt[1:] + [x], key, q.prefix)
                self.hooks.lap("head_prefill")
        return finished

    def _keep(self, rows: list[int]) -> None:
        filter_rows(self.caches, rows)
        if self.drafter is not None and self.drafter.rows:
            self.drafter.filter(rows)
        index = mx.array(rows, dtype=mx.int32)
        self._map_ahead(lambda a: a[index] if rows else None)
        self._fed = [self._fed[r] for r in rows]
        self.rows = [self.rows[r] for r in rows]

    @property
    def _head_off(self) -> bool:
        """Mode "auto" settled on plain steps: its own drafter is dropped
        (`_drop_head`) and no other is made."""
        return self._own_drafter and self.controller is not None and self.controller.settled

    def _drop_head(self) -> None:
        """The head stops consuming the rows' pairs (its drafts would never
        be taken)."""
        self.drafter = None
        self._ahead_hidden = None

    def _map_ahead(self, change) -> None:
        """Apply ``change`` to each per-row array of the dispatched plain
        step that is set (its tokens, hiddens and logits)."""
        self._ahead, self._ahead_hidden, self._ahead_logits = (
            None if a is None else change(a) for a in (self._ahead, self._ahead_hidden, self._ahead_logits))

    def _result(self, row: _Row) -> GenerationResult:
        s = row.stats
        s.decode_s = time.perf_counter() - row.joined_at
        s.generated_tokens = len(row.finisher.tokens)
        reason = row.finisher.reason or "length"
        g = row.grammar
        note = (f"max_tokens ({row.finisher.max_tokens}) ended the output before it matched {g.constraint.describe()}"
                if g is not None and reason == "length" and not g.accepting else None)
        return GenerationResult(tokens=row.finisher.tokens, text=row.finisher.text(), finish_reason=reason, stats=s,
                                prompt_tokens=row.prompt, trace=row.trace,
                                logprobs=row.lp[: len(row.finisher.tokens)] if row.logprobs is not None else None,
                                note=note)

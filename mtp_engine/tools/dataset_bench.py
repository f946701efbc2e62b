"""Dataset throughput, side by side in one process: what a job over many
prompts moves.

``python -m mtp_engine.bench --suite dataset`` decodes the same prompts with
plain decoding one row at a time, the single-sequence chain, plain batching
(the engine's batched decoder without drafts, and mlx-lm's
``BatchGenerator`` for reference) and batched speculation at each K, at
each batch size. For each it reports aggregate completion tokens per second
over the whole dataset (prefill included) and over decoding only (the rows'
prefill time left out), acceptance length, peak memory, and whether every
row equals plain decoding. A cost model prices a batched step (a verify
forward over ``B x (K+1)`` tokens with its read-back and ragged commit,
against a plain step over ``B x 1``; `step_costs`) and gives engine
efficiency (measured / predicted speedup over plain batching).

With ``--acceptance-profile 0.93,0.82,0.64`` (random-weight models, whose
drafts are never right) the head still runs every step but its tokens are
replaced by the true continuation at that profile (`mtp_engine.tools.projection`):
those figures are labelled "projected at profile ...".
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from mtp_engine.cache.batch import append_row, commit_rows, make_batch_cache
from mtp_engine.cache.capture import StateCaptureCache, make_main_cache
from mtp_engine.decoder import Decoder
from mtp_engine.modes import DecodeConfig
from mtp_engine.sampling import GREEDY
from mtp_engine.stopping import Finisher
from mtp_engine.tools.loops import find_loop
from mtp_engine.tools.phases import PhaseTimer
from mtp_engine.tools.projection import ProjectedDrafts, ProjectingDrafter, parse_profile


@dataclass
class Run:
    """One way of decoding the whole prompt set."""

    mode: str
    batch_size: int
    draft_tokens: int
    tokens: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    steps: int = 0
    batch_steps: int = 0  # decoder steps (batched runs)
    accepted: int = 0
    peak_memory: int = 0
    identical: int = 0  # outputs (every round's) equal to the reference
    outputs: list = field(default_factory=list)  # the first round's
    later_outputs: list = field(default_factory=list)  # rounds after the first, in order
    phase_seconds: dict | None = None

    def row(self, plain: "Run | None", profile: str | None) -> dict:
        decode_s = max(self.seconds - self.prefill_seconds, 1e-9)
        out = {
            "mode": self.mode,
            "batch_size": self.batch_size,
            "draft_tokens": self.draft_tokens,
            "prompts": len(self.outputs),
            "tokens": self.tokens,
            "tokens_per_s": round(self.tokens / self.seconds, 2),
            "decode_tokens_per_s": round(self.tokens / decode_s, 2),
            "prefill_share": round(self.prefill_seconds / self.seconds, 3),
            "acceptance_length": round((self.accepted + self.steps) / self.steps, 3) if self.draft_tokens else None,
            "batch_steps": self.batch_steps or None,
            "identical": f"{self.identical}/{len(self.outputs) + len(self.later_outputs)}",
            "peak_memory_gb": round(self.peak_memory / 2**30, 3),
        }
        if profile and self.draft_tokens:
            out["projected_at_profile"] = profile
        if self.phase_seconds is not None:
            out["phase_seconds"] = {k: round(v, 3) for k, v in self.phase_seconds.items()}
        if plain is not None:
            out["speedup_over_plain_one_at_a_time"] = round(out["tokens_per_s"] * plain.seconds / plain.tokens, 3)
        return out


def _absorb(run: Run, again: Run) -> None:
    """Another round of ``run``'s mode: its totals add to ``run``'s, its
    outputs join ``run.later_outputs``."""
    for name in ("tokens", "seconds", "prefill_seconds", "steps", "batch_steps", "accepted"):
        setattr(run, name, getattr(run, name) + getattr(again, name))
    run.peak_memory = max(run.peak_memory, again.peak_memory)
    if run.phase_seconds is not None:
        for phase, seconds in (again.phase_seconds or {}).items():
            run.phase_seconds[phase] = run.phase_seconds.get(phase, 0.0) + seconds
    run.later_outputs += again.outputs + again.later_outputs


def rotated(items: list, n: int) -> list:
    """``items`` starting at index ``n`` (modulo its length), wrapping round."""
    n %= len(items)
    return items[n:] + items[:n]


def _progress(run: Run) -> str:
    """A timed run in one line (what a killed run still leaves in its log)."""
    r = run.row(None, None)
    line = f"{r['tokens_per_s']:.1f} tok/s (decode {r['decode_tokens_per_s']:.1f})"
    if r["acceptance_length"]:
        line += f", acceptance {r['acceptance_length']:.2f}"
    line += f", peak {r['peak_memory_gb']:.2f} GB"
    if run.phase_seconds:
        line += f"; {run.batch_steps} steps, seconds " + ", ".join(f"{k} {v:.2f}" for k, v in run.phase_seconds.items())
    return line


def _projections(engine, n: int, references, profile, first_seed: int = 0) -> list:
    """Each prompt's `ProjectedDrafts` (None for all without a profile),
    prompt ``i`` drawing with seed ``first_seed + i``."""
    if references is None:
        return [None] * n
    vocab = engine.text.args.vocab_size
    return [ProjectedDrafts(profile, ref, vocab, seed=first_seed + i) for i, ref in enumerate(references)]


def decode_prompts(engine, prompts, max_tokens: int | list[int], batch_size: int, k: int, projections=None,
                   hooks=None, auto: bool = False) -> tuple[list, int]:
    """The prompts through one `Decoder` (k = 0: plain decoding; ``auto``:
    mode "auto", at most k drafts a step), drafts projected where
    ``projections`` (one per prompt, or None) say; returns the results in
    order and the decoder's steps."""
    mode = "auto" if auto else "chain" if k else "baseline"
    decode = DecodeConfig(mode=mode, draft_tokens=k or 1, batch_size=batch_size)
    drafter = None
    if k and projections is not None and any(p is not None for p in projections):
        inner = engine.make_drafter(engine.pick_drafter("chain"))
        drafter = ProjectingDrafter(inner, {(i, 0): p for i, p in enumerate(projections) if p is not None})
    decoder = Decoder(engine, decode, hooks=hooks, drafter=drafter)
    for i, ids in enumerate(prompts):
        decoder.add(i, ids, [GREEDY], max_tokens=max_tokens[i] if isinstance(max_tokens, list) else max_tokens)
    results, steps = {}, 0
    while decoder.pending:
        results.update(decoder.step())
        steps += 1
    return [results[(i, 0)] for i in range(len(prompts))], steps


def run_batched(engine, prompts, max_tokens: int | list[int], batch_size, k, references=None, profile=None,
                phases: bool = False, first_seed: int = 0, auto: bool = False) -> Run:
    """The prompt set through the `Decoder` (k = 0: plain batching);
    ``max_tokens`` for every prompt or one per prompt; ``phases``: time
    each phase of the decoder (`mtp_engine.tools.phases.PHASES`),
    synchronizing after each; with a profile, prompt ``i`` draws its
    acceptances with seed ``first_seed + i``."""
    timer = PhaseTimer() if phases else None
    run = Run("batched auto" if auto else "batched chain" if k else "plain batching", batch_size, k,
              phase_seconds=timer.seconds if timer else None)
    projections = _projections(engine, len(prompts), references if k else None, profile, first_seed)
    mx.reset_peak_memory()
    t = time.perf_counter()
    results, run.batch_steps = decode_prompts(engine, prompts, max_tokens, batch_size, k, projections, timer, auto)
    run.seconds = time.perf_counter() - t
    run.peak_memory = mx.get_peak_memory()
    _collect(run, results)
    return run


def run_single(engine, prompts, max_tokens, k, references=None, profile=None) -> Run:
    """One prompt at a time through `MTPEngine.generate` (k = 0: plain)."""
    run = Run("single-sequence chain" if k else "plain, one at a time", 1, k)
    projections = _projections(engine, len(prompts), references if k else None, profile)
    mx.reset_peak_memory()
    t = time.perf_counter()
    results = [_decode(engine, ids, max_tokens, k, projections[i]) for i, ids in enumerate(prompts)]
    run.seconds = time.perf_counter() - t
    run.peak_memory = mx.get_peak_memory()
    _collect(run, results)
    return run


def run_singles_interleaved(engine, prompts, max_tokens, ks: list[int], references, profile, rounds: int) -> list[Run]:
    """Plain decoding and a chain per K in ``ks``, one prompt at a time,
    interleaved: each prompt goes through every mode in turn (the order
    rotating), ``rounds`` times over the set, so the host's speed drifting
    during the run falls on every mode alike. Returns the runs in the order
    plain, ``ks``; their outputs are the first round's, the other rounds'
    in ``later_outputs``.

    With a profile each round draws its acceptances with seeds of its own
    (every chain of a round the same ones): over one prompt, one draw of
    about forty steps can sit a tenth or more off what the profile implies
    (docs/BENCHMARKS.md), so the rounds average several."""
    runs = [Run("plain, one at a time", 1, 0)] + [Run("single-sequence chain", 1, k) for k in ks]
    for r in range(rounds):
        projections = {k: _projections(engine, len(prompts), references if k else None, profile, r * len(prompts))
                       for k in [0, *ks]}
        for i, ids in enumerate(prompts):
            for run in rotated(runs, i + r):
                k = run.draft_tokens
                mx.reset_peak_memory()
                t = time.perf_counter()
                result = _decode(engine, ids, max_tokens, k, projections[k][i])
                run.seconds += time.perf_counter() - t
                run.peak_memory = max(run.peak_memory, mx.get_peak_memory())
                _collect(run, [result])
                if r:
                    run.later_outputs.append(run.outputs.pop())  # the first round's outputs stand for the run
    return runs


def _decode(engine, ids, max_tokens, k, projection):
    """One prompt alone: plain (k = 0) or a chain of K = k."""
    return decode_prompts(engine, [ids], max_tokens, 1, k, [projection])[0][0]


def _collect(run: Run, results) -> None:
    for r in results:
        run.tokens += len(r.tokens)
        run.prefill_seconds += r.stats.prefill_s
        run.steps += r.stats.steps
        run.accepted += r.stats.accepted
        run.outputs.append(r.tokens)


def run_mlx_lm(engine, prompts, max_tokens, batch_size) -> Run:
    """mlx-lm's own continuous batching (``BatchGenerator``) for reference."""
    run = Run("mlx-lm BatchGenerator", batch_size, 0)
    gen = BatchGenerator(engine.model, stop_tokens=[[t] for t in sorted(engine.eos_token_ids)],
                         completion_batch_size=batch_size, prefill_batch_size=min(batch_size, 8),
                         prefill_step_size=engine.prefill_step_size)
    finishers = {}
    outputs = {}
    mx.reset_peak_memory()
    t = time.perf_counter()
    uids = gen.insert(prompts, [max_tokens] * len(prompts))
    order = {uid: i for i, uid in enumerate(uids)}
    for uid in uids:
        finishers[uid] = Finisher(engine.tokenizer, engine.eos_token_ids, max_tokens, [])
    while len(outputs) < len(prompts):
        for response in gen.next_generated():
            f = finishers[response.uid]
            f.add([response.token])
            if response.finish_reason is not None or f.done:
                outputs[order[response.uid]] = f.tokens
    gen.close()
    run.seconds = time.perf_counter() - t
    run.peak_memory = mx.get_peak_memory()
    for i in range(len(prompts)):
        run.tokens += len(outputs[i])
        run.outputs.append(outputs[i])
    return run


def step_costs(engine, prompts, batch_size: int, ks: list[int], repeats: int = 10) -> dict:
    """Mean seconds of a batched step over ``[B, K+1]`` as the decoder runs
    one, for K = 0 and each K, after the rows' prefill: the forward over
    tokens of the rows' prompts (so an MoE routes as it does on text; one
    repeated token sends every row to the same experts), the logits read
    back, and a ragged commit (row ``b`` keeps ``1 + b % (K+1)`` inputs, so
    the per-row gathers run). The commit's work is lazy, as in the decoder:
    each step's evaluation finishes the one before, and the timing ends with
    the last commit evaluated."""
    model = engine.model
    caches = make_batch_cache(model)
    rows = [prompts[i % len(prompts)] for i in range(batch_size)]
    for n, ids in enumerate(rows):
        c = make_main_cache(model)
        engine.prefill(ids, c, keep_hidden=False)
        append_row(caches, c, n)
    out = {}
    for k in [0, *ks]:
        width = k + 1
        tokens = mx.array([[ids[(j + 1) % len(ids)] for j in range(width)] for ids in rows], dtype=mx.int32)
        keep = [1 + b % width for b in range(batch_size)]

        def step():
            for c in caches:
                if isinstance(c, StateCaptureCache) and width > 1:
                    c.begin_capture()
            mx.eval(engine.lm_head(model.model(tokens, cache=caches)))
            commit_rows(caches, width, keep)

        step()
        mx.eval([c.state for c in caches])
        t = time.perf_counter()
        for _ in range(repeats):
            step()
        mx.eval([c.state for c in caches])
        out[k] = (time.perf_counter() - t) / repeats
    return out


ALL_ACCEPTED = (1.0,)
"""A profile that keeps every draft: warm-ups whose rows leave on time."""


def _one_leaving_a_step(rows: int, k: int) -> list[int]:
    """Budgets under which ``rows`` rows of a chain of K = ``k`` whose drafts
    are all accepted (K + 1 tokens a step) leave one a step: row ``i`` ends
    after ``1 + (i + 1)(k + 1)`` tokens (its prefill's token, then i + 1
    steps)."""
    return [1 + (i + 1) * (k + 1) for i in range(rows)]


def warm_up(engine, prompts, batch_sizes, draft_tokens, single_k, profile=None) -> None:
    """Every path of the timed runs once, untimed: kernels, traces, CUDA
    graphs, the allocator. The prompts as timed, not shortened: kernels may
    be chosen by context length.

    A verify forward of a ``[rows, width]`` shape new to the process costs
    far more than the next one: on the H200, 0.2-1.1 s against 80 ms for
    the 80B shapes at B=32 (docs/BENCHMARKS.md). A timed batched chain meets
    a shape per row count in its tail, as rows finish at different steps, so
    at each batch size B the warm-up covers:

    - plain batching, row ``i`` ending after ``1 + (i + 1)(K + 1)`` tokens
      (K the deepest chain): every ``[rows, 1]`` step from B rows down;
    - each chain K on the same budgets for its depth, its drafts replaced by
      plain batching's tokens and all accepted (`ALL_ACCEPTED`), so row ``i``
      leaves after step ``i + 1``: every ``[rows, K + 1]`` verify forward;
    - each chain K again with rows ending one token apart (``2 + i``),
      drafts at ``profile`` when given (accepted in part, as timed): the
      head's narrower pending widths and the short verify forwards of rows
      near their budgets.

    - mode auto's steps of every width up to the deepest K at every bucket
      of rows (`Decoder.warm_up`).

    Then one-at-a-time decoding and each single-sequence chain on the
    first prompt, 16 tokens."""
    deepest = max(draft_tokens, default=0)
    for b in batch_sizes:
        if deepest:  # mode auto's steps: every bucket of rows at every width (`Decoder.warm_up`)
            Decoder(engine, DecodeConfig(mode="auto", draft_tokens=deepest, batch_size=b)).warm_up(GREEDY)
        rows = [prompts[i % len(prompts)] for i in range(b)]
        plain = run_batched(engine, rows, _one_leaving_a_step(b, deepest), b, 0)
        for k in draft_tokens:
            run_batched(engine, rows, _one_leaving_a_step(b, k), b, k, plain.outputs, ALL_ACCEPTED)
            run_batched(engine, rows, [2 + i for i in range(b)], b, k, plain.outputs if profile else None, profile)
    few = prompts[:1]
    plain = run_single(engine, few, 16, 0)
    for k in single_k:
        run_single(engine, few, 16, k, plain.outputs if profile else None, profile)


def dataset_suite(engine, prompts, args, log) -> dict:
    """Every way of decoding ``prompts``, side by side; returns the report."""
    profile = args.acceptance_profile
    log(f"dataset: {len(prompts)} prompts x {args.max_tokens} tokens"
        + (f", drafts projected at profile {profile}" if profile else ""))
    phases = getattr(args, "phase_times", False)
    parsed = parse_profile(profile) if profile else None
    warm_up(engine, prompts, args.batch_sizes, args.draft_tokens, args.single_k, parsed)

    limit = getattr(args, "single_limit", None)
    if limit and getattr(args, "loop_free", False):
        raise SystemExit("--single-limit and --loop-free do not combine (loops are found in plain outputs)")
    if limit and limit < len(prompts) and not args.batch_sizes:
        raise SystemExit("--single-limit needs a --batch-sizes entry (plain batching decodes the other prompts' "
                         "reference)")
    single = prompts[:limit] if limit else prompts
    plain = run_single(engine, single, args.max_tokens, 0)
    # The reference every row is compared with (and projected drafts follow):
    # plain decoding one at a time; past --single-limit, the first plain
    # batching run (equal to it on CPU float32; on-device, near-ties aside).
    reference = list(plain.outputs)
    first_batch = None
    if len(single) < len(prompts):
        first_batch = run_batched(engine, prompts, args.max_tokens, args.batch_sizes[0], 0, phases=phases)
        reference += first_batch.outputs[len(single):]
    looping = sum(find_loop(o) is not None for o in reference)
    loops = {"prompts": len(prompts), "ending_in_a_loop": looping, "timed": "all prompts"}
    log(f"  {looping} of {len(prompts)} plain outputs end in a repeating loop")
    if getattr(args, "loop_free", False):
        # Time only the prompts whose plain output does not loop (a loop is
        # where the head is always right).
        prompts = [p for p, o in zip(prompts, plain.outputs) if find_loop(o) is None]
        if not prompts:
            raise SystemExit("--loop-free: every plain output loops; use more prompts or tokens")
        loops["timed"] = f"the {len(prompts)} loop-free prompts"
        log(f"  timing the {len(prompts)} loop-free prompts only")
        single = prompts
        plain = run_single(engine, prompts, args.max_tokens, 0)
        reference = list(plain.outputs)
    references = reference if profile else None
    rounds = getattr(args, "single_rounds", 0)
    if rounds:
        runs = run_singles_interleaved(engine, single, args.max_tokens, args.single_k, references, parsed, rounds)
        plain = runs[0]
        for run in runs:
            log(f"  {run.mode}{f' K={run.draft_tokens}' if run.draft_tokens else ''}, {rounds} interleaved "
                f"rounds: {_progress(run)}")
    else:
        runs = [plain]
        for k in args.single_k:
            runs.append(run_single(engine, single, args.max_tokens, k, references, parsed))
            log(f"  single-sequence chain K={k}: {_progress(runs[-1])}")
        log(f"  plain one at a time: {_progress(plain)}"
            + (f" (the first {len(single)} prompts)" if len(single) < len(prompts) else ""))
    costs = {}
    batch_rounds = getattr(args, "batch_rounds", 1)
    for b in args.batch_sizes:
        if args.mlx_lm_batch:
            runs.append(run_mlx_lm(engine, prompts, args.max_tokens, b))
        # side by side; with rounds, each round starts one mode later, and
        # draws acceptances of its own, so a drifting host speed falls on
        # every mode alike
        modes = [(k, False) for k in [0, *args.draft_tokens]] + [(k, True) for k in getattr(args, "auto_k", [])]
        timed = {}
        for rnd in range(batch_rounds):
            for mode in rotated(modes, rnd):
                k, auto = mode
                if rnd == 0 and first_batch is not None and b == args.batch_sizes[0] and mode == (0, False):
                    run = first_batch
                else:
                    run = run_batched(engine, prompts, args.max_tokens, b, k, references, parsed, phases,
                                      rnd * len(prompts), auto)
                log(f"  B={b} {('auto K<=' if auto else 'K=') + str(k) if k else 'plain'}"
                    f"{f', round {rnd + 1}' if batch_rounds > 1 else ''}: {_progress(run)}")
                if mode in timed:
                    _absorb(timed[mode], run)
                else:
                    timed[mode] = run
        runs += [timed[mode] for mode in modes]
        costs[b] = step_costs(engine, prompts, b, args.draft_tokens)
    for r in runs:
        r.identical = sum(a == reference[i % len(r.outputs)] for i, a in enumerate(r.outputs + r.later_outputs))
    rows = [r.row(plain, profile) for r in runs]
    settings = {"prompts": len(prompts), "max_tokens": args.max_tokens, "context": args.context,
                "acceptance_profile": profile}
    if rounds:
        settings["single_sequence_rounds"] = f"{rounds}, interleaved prompt by prompt"
    if batch_rounds > 1:
        settings["batched_rounds"] = f"{batch_rounds}, each starting one mode later"
    if len(single) < len(prompts):
        settings["single_sequence_prompts"] = len(single)
        settings["reference"] = (f"plain decoding one at a time for the first {len(single)} prompts, plain "
                                 f"batching at B={args.batch_sizes[0]} for the rest")
    return {"settings": settings, "loops": loops, "dataset_runs": rows,
            "batched_cost_model": batched_cost_model(costs, rows)}


def batched_cost_model(costs: dict, rows: list[dict]) -> list[dict]:
    """Per batch size and K: a verify forward over B x (K+1) against B x 1,
    the speedup over plain batching they predict at the measured acceptance,
    the measured decode speedup, and their ratio (engine efficiency)."""
    out = []
    plain = {r["batch_size"]: r for r in rows if r["mode"] == "plain batching"}
    for r in rows:
        if r["mode"] != "batched chain" or r["batch_size"] not in costs:
            continue
        c, k = costs[r["batch_size"]], r["draft_tokens"]
        predicted = r["acceptance_length"] * c[0] / c[k]
        measured = r["decode_tokens_per_s"] / plain[r["batch_size"]]["decode_tokens_per_s"]
        out.append({"batch_size": r["batch_size"], "draft_tokens": k, "verify_ratio": round(c[k] / c[0], 3),
                    "forward_1_ms": round(c[0] * 1e3, 3), "predicted_speedup": round(predicted, 3),
                    "measured_decode_speedup": round(measured, 3), "efficiency": round(measured / predicted, 3)})
    return out


def print_dataset_table(report: dict, log) -> None:
    log(f"{'mode':<24}{'B':>4}{'K':>3}{'tok/s':>9}{'decode':>9}{'x plain':>9}{'accept':>8}{'ident':>8}{'peakGB':>8}")
    for r in report["dataset_runs"]:
        al = f"{r['acceptance_length']:.2f}" if r["acceptance_length"] else "-"
        mode = r["mode"]
        log(f"{mode:<24}{r['batch_size']:>4}{r['draft_tokens']:>3}{r['tokens_per_s']:>9.1f}"
            f"{r['decode_tokens_per_s']:>9.1f}{r.get('speedup_over_plain_one_at_a_time', 0):>9.2f}{al:>8}"
            f"{r['identical']:>8}{r['peak_memory_gb']:>8.2f}")
    for c in report["batched_cost_model"]:
        log(f"  B={c['batch_size']} K={c['draft_tokens']}: verify {c['verify_ratio']}x a plain batched step "
            f"({c['forward_1_ms']} ms), predicted {c['predicted_speedup']}x, measured {c['measured_decode_speedup']}x,"
            f" efficiency {c['efficiency']}")

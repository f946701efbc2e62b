"""Benchmarks, measured side by side in one process.

``python -m mtp_engine.bench`` (``make bench``) times plain greedy decoding
(the engine's ``baseline`` and mlx-lm's own ``generate_step``) and every
speculative mode on the same prompts, interleaved round-robin so drift hits
all modes alike, checks every mode's tokens against baseline, fits a cost
model (forward time by width, MTP step time, predicted speedup and engine
efficiency) and measures dataset throughput of the batch mode.

``--synthetic 80b`` (or ``qwen3.5-27b``, ``qwen3.5-35b-a3b``) benchmarks costs
at real scale on random 4-bit weights with those models' shapes (acceptance
there means nothing: project it with ``--acceptance-profile``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx_lm
import orjson
from mlx_lm.generate import generate_step

from mtp_engine.cache.capture import StateCaptureCache, make_main_cache
from mtp_engine.engine import MTPEngine
from mtp_engine.kernels import cpu_blas
from mtp_engine.model.compiled import CompiledDecoderLayer
from mtp_engine.model.gated_delta import recurrence_path
from mtp_engine.model.rowwise import RowwiseLinear
from mtp_engine.modes import DecodeConfig
from mtp_engine.options import EngineOptions
from mtp_engine.backend import mlx_settings
from mtp_engine.sampling import GREEDY
from mtp_engine.tools.dataset_bench import (
    dataset_suite,
    print_dataset_table,
    rotated,
    run_batched,
)
from mtp_engine.tools.host_cost import host_cost_suite, print_host_cost_table
from mtp_engine.tools.loops import find_loop
from mtp_engine.tools.prefill_cost import prefill_cost_suite, print_prefill_cost_table
from mtp_engine.tools.synthetic import (
    SYNTHETIC,
    random_quantized_checkpoint,
)

DEFAULT_MODEL = "models/qwen3-next-tiny-stdlib"
DEFAULT_PROMPTS = "examples/prompts.jsonl"

# name -> generate() keyword arguments; "mlx_lm" is mlx-lm's generate_step.
MODE_SPECS = {
    "baseline": dict(mode="baseline"),
    "mlx_lm": None,
    "chain-k2": dict(mode="chain", draft_tokens=2),
    "chain-k3": dict(mode="chain", draft_tokens=3),
    "chain-k4": dict(mode="chain", draft_tokens=4),
    "chain-k6": dict(mode="chain", draft_tokens=6),
    # The controller: 0..K drafts a step, as it measures (mtp_engine.controller).
    "auto-k3": dict(mode="auto", draft_tokens=3),
    "auto-k4": dict(mode="auto", draft_tokens=4),
    # The same chains drafted by the MLX head, where the C++ head (CPU) or the
    # chain kernel (CUDA) is the default.
    "chain-k4-mlxdraft": dict(mode="chain", draft_tokens=4, drafter="mlx"),
    "chain-k6-mlxdraft": dict(mode="chain", draft_tokens=6, drafter="mlx"),
    # In OPTIONAL_MODES (not the default run): the MLX head without
    # compilation, and deeper chains (which pay where drafts are cheap: the
    # chain kernel on CUDA).
    "chain-k4-eagerhead": dict(mode="chain", draft_tokens=4, drafter="mlx-eager"),
    "chain-k6-eagerhead": dict(mode="chain", draft_tokens=6, drafter="mlx-eager"),
    "chain-k8": dict(mode="chain", draft_tokens=8),
    "chain-k8-mlxdraft": dict(mode="chain", draft_tokens=8, drafter="mlx"),
    "chain-k10": dict(mode="chain", draft_tokens=10),
    "chain-k12": dict(mode="chain", draft_tokens=12),
    "chain-k15": dict(mode="chain", draft_tokens=15),
    "adaptive-k5": dict(mode="adaptive", draft_tokens=5, tau=0.5),
    "tree-k3": dict(mode="tree", draft_tokens=3),
    "adaptive_tree-k5": dict(mode="adaptive_tree", draft_tokens=5, tau=0.5),
    "paths-k3-p2": dict(mode="paths", draft_tokens=3, paths=2),
    "paths-k3-p3": dict(mode="paths", draft_tokens=3, paths=3),
}

OPTIONAL_MODES = (
    "auto-k4", "chain-k4-eagerhead", "chain-k6-eagerhead", "chain-k8", "chain-k8-mlxdraft", "chain-k10", "chain-k12", "chain-k15",
)
"""Specs only ``--modes`` asks for."""
DEFAULT_MODES = tuple(n for n in MODE_SPECS if n not in OPTIONAL_MODES)
"""What ``make bench`` times."""


@dataclass
class ModeTotals:
    name: str
    params: dict | None
    tokens: int = 0
    seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_tokens: int = 0
    steps: int = 0
    accepted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    identical: int = 0
    compared: int = 0
    peak_memory: int = 0
    outputs: dict = field(default_factory=dict)
    per_prompt: dict = field(default_factory=dict)  # prompt index -> [tokens, seconds]

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def row(self, baseline: "ModeTotals | None") -> dict:
        tps = self.tokens / self.seconds if self.seconds else 0.0
        base_tps = baseline.tokens / baseline.seconds if baseline and baseline.seconds else None
        base_dtps = baseline.decode_tps if baseline else None
        return {
            "mode": self.name,
            "params": self.params,
            "tokens_per_s": round(tps, 2),
            "decode_tokens_per_s": round(self.decode_tps, 2) if self.decode_seconds else None,
            "speedup": round(tps / base_tps, 3) if base_tps else None,
            "decode_speedup": round(self.decode_tps / base_dtps, 3) if base_dtps and self.decode_seconds else None,
            "acceptance_length": round((self.accepted + self.steps) / self.steps, 3) if self.steps else None,
            "identical": self.identical == self.compared,
            "identical_count": f"{self.identical}/{self.compared}",
            "draft_share": round(self.draft_s / self.decode_seconds, 3) if self.decode_seconds and self.steps else None,
            "verify_share": round(self.verify_s / self.decode_seconds, 3) if self.decode_seconds and self.steps else None,
            "peak_memory_gb": round(self.peak_memory / 2**30, 3),
        }


def machine_info() -> dict:
    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
    }
    if settings := mlx_settings():
        info["mlx_environment"] = settings
    if mx.default_device() == mx.cpu:
        info["blas"] = cpu_blas.active()
        if (rows := cpu_blas.few_rows()) is not None:
            info["blas_few_rows"] = rows
    try:

        info["mlx_lm"] = mlx_lm.__version__
    except Exception:
        pass
    if mx.default_device() == mx.gpu:
        try:
            info["gpu"] = mx.device_info().get("device_name") if hasattr(mx, "device_info") else None
        except Exception:
            pass
    return info


def mlx_lm_generate(engine: MTPEngine, ids: list[int], max_tokens: int) -> list[int]:
    """mlx-lm's own greedy decoding of the same model (no EOS handling)."""
    eos = engine.eos_token_ids
    out = []
    for token, _ in generate_step(mx.array(ids), engine.model, max_tokens=max_tokens):
        if token in eos:
            break
        out.append(int(token))
    return out


def run_modes(
    engine, prompts: list[list[int]], names: list[str], max_tokens: int, rounds: int, log, warmup: bool = True,
    specs: dict | None = None, reference: str = "baseline",
) -> dict:
    """Time ``names`` (keys of ``specs``, default `MODE_SPECS`) round-robin
    over the prompts; compare every output with ``reference``'s. Sampling
    specs sample prompt ``i`` with seed ``i``."""
    specs = specs or MODE_SPECS
    totals = {n: ModeTotals(n, specs[n]) for n in names}
    if warmup:
        # Every path once first (kernel compilation, allocator caches).
        for n in names:
            _run_one(engine, prompts[0], specs[n], min(max_tokens, 16), 0)
    for r in range(rounds):
        for i, ids in enumerate(prompts):
            for n in rotated(names, i):
                mx.reset_peak_memory()
                t = time.perf_counter()
                result = _run_one(engine, ids, specs[n], max_tokens, i)
                elapsed = time.perf_counter() - t
                tot = totals[n]
                tot.peak_memory = max(tot.peak_memory, mx.get_peak_memory())
                tot.seconds += elapsed
                spent = tot.per_prompt.setdefault(i, [0, 0.0])
                spent[0] += len(result) if n == "mlx_lm" else len(result.tokens)
                spent[1] += elapsed
                if n == "mlx_lm":
                    tokens = result
                    tot.tokens += len(tokens)
                else:
                    tokens = result.tokens
                    s = result.stats
                    tot.tokens += len(tokens)
                    tot.decode_seconds += s.decode_s
                    tot.decode_tokens += max(len(tokens) - 1, 0)
                    tot.steps += s.steps if s.draft_tokens else 0
                    tot.accepted += s.accepted
                    tot.draft_s += s.draft_s
                    tot.verify_s += s.verify_s
                if r == 0:
                    tot.outputs[i] = tokens
            if (i + 1) % max(1, len(prompts) // 4) == 0 or i + 1 == len(prompts):
                log(f"round {r + 1}/{rounds}: {i + 1}/{len(prompts)} prompts, every mode")
    base = totals.get(reference)
    for tot in totals.values():
        for i, tokens in tot.outputs.items():
            if base is not None:
                tot.compared += 1
                tot.identical += tokens == base.outputs[i]
    return totals


def _run_one(engine, ids, spec, max_tokens, index):
    if spec is None:
        return mlx_lm_generate(engine, ids, max_tokens)
    seed = {"seed": index} if spec.get("temperature") else {}
    return engine.generate(ids, max_tokens=max_tokens, **spec, **seed)


def loop_free(totals: dict, reference: str) -> dict:
    """Each mode's speedup over ``reference`` on the prompts whose
    reference output does not end in a repeating loop (`tools.loops`), and
    how many prompts that is: the figure to report beside every speedup."""
    base = totals[reference]
    clean = [i for i, tokens in base.outputs.items() if find_loop(tokens) is None]
    out = {"prompts": len(base.outputs), "loop_free_prompts": len(clean)}
    if not clean:
        return out

    def tps(tot):
        tokens = sum(tot.per_prompt[i][0] for i in clean)
        seconds = sum(tot.per_prompt[i][1] for i in clean)
        return tokens / seconds if seconds else 0.0

    base_tps = tps(base)
    out["speedup"] = {name: round(tps(tot) / base_tps, 3) for name, tot in totals.items() if base_tps}
    return out


def forward_costs(engine: MTPEngine, context: list[int], widths: list[int], repeats: int = 20) -> dict:
    """Seconds of a verify forward (capturing states) over T tokens, and of one
    MTP draft step, after a prefill of ``context`` (medians of ``repeats``)."""
    model = engine.model
    caches = prefilled_caches(engine, context)
    out = {}
    for width in widths:
        verify_forward(engine, caches, width)
        out[width] = _median_seconds(lambda: verify_forward(engine, caches, width), repeats)
    n = min(64, len(context))
    hidden = model.model(mx.array(context[-n:])[None], cache=make_main_cache(model))
    pairs = context[len(context) - n + 1 :] + [7]
    h1 = mx.contiguous(hidden[:, -1:])
    mx.eval(h1)
    kind = engine.pick_drafter("chain")
    out = {"verify_s": out, "drafter": kind}
    step_kind = "cpp" if kind == "cpp" else engine.pick_drafter("chain", "mlx")  # one pair in, one draft out
    out["mtp_step_s"] = _median_seconds(draft_probe(engine, step_kind, hidden, pairs, h1, 1), repeats)
    if step_kind == "mlx":
        out["mtp_step_eager_s"] = _median_seconds(draft_probe(engine, "mlx-eager", hidden, pairs, h1, 1), repeats)
    if kind == "cuda":
        out["kernel_chain_s"] = {
            k: _median_seconds(draft_probe(engine, "cuda", hidden, pairs, h1, k), repeats) for k in range(1, max(widths))
        }
    return out


def draft_probe(engine: MTPEngine, kind: str, hidden: mx.array, pairs: list[int], h1: mx.array, k: int):
    """A callable that drafts a chain of ``k`` from one pending pair
    ``(h1, 7)`` with a fresh drafter of ``kind`` (tokens read back; the
    head's cache rewound by the next call's commit), after the head consumed
    ``pairs`` (their hiddens ``hidden``); it is called once here, as a
    warm-up."""
    drafter = engine.make_drafter(kind)
    drafter.add_row(None, hidden, pairs)
    decode = DecodeConfig(draft_tokens=k)
    drafter.propose(decode, 1, [GREEDY], [0], [1]).tokens.tolist()

    def chain():
        drafter.commit(h1, [[7]], [0])
        drafter.propose(decode, k, [GREEDY], [0], [k]).tokens.tolist()

    chain()
    return chain


def prefilled_caches(engine: MTPEngine, context: list[int], chunk: int = 2048) -> list:
    """Fresh engine caches with ``context`` prefilled, ``chunk`` tokens a
    forward (the cost probes' starting point)."""
    caches = make_main_cache(engine.model)
    for start in range(0, len(context), chunk):
        engine.model.model(mx.array(context[start : start + chunk])[None], cache=caches)
        mx.eval([c.state for c in caches])
    return caches


def verify_forward(engine: MTPEngine, caches: list, width: int) -> tuple[float, float]:
    """One verify forward over ``width`` tokens on ``caches`` (capturing
    states, logits of every token), evaluated, then rolled back.

    Returns:
        Seconds of host graph building (up to the lazy logits) and of the
        evaluation.
    """
    for c in caches:
        if isinstance(c, StateCaptureCache):
            c.begin_capture()
    t0 = time.perf_counter()
    logits = engine.lm_head(engine.model.model(mx.array([[7] * width]), cache=caches))
    t1 = time.perf_counter()
    mx.eval(logits, [c.state for c in caches])
    t2 = time.perf_counter()
    for c in caches:
        if c.is_trimmable():
            c.trim(width)
        else:
            c.clear_captured()
    return t1 - t0, t2 - t1


def _median_seconds(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` (each call ends in a sync), so a stray
    stall (a new trace, a collection, a neighbour on a shared machine) does
    not move the figure."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def cost_model(costs: dict, rows: list[dict], totals: dict | None = None) -> dict:
    """Predicted chain speedups from forward costs and measured acceptance;
    with ``totals``, the share of a decode step the engine adds on top of
    its forwards (overhead)."""
    v = costs["verify_s"]
    t1 = v[1]
    out = {
        "forward_ratio": {str(t): round(s / t1, 3) for t, s in v.items()},
        "forward_1_ms": round(t1 * 1e3, 3),
        "mtp_step_ratio": round(costs["mtp_step_s"] / t1, 3),
        "chain_drafter": costs.get("drafter", "mlx"),
        "predicted": [],
    }
    if "mtp_step_eager_s" in costs:
        out["mtp_step_eager_ratio"] = round(costs["mtp_step_eager_s"] / t1, 3)
    kernel = costs.get("kernel_chain_s")
    if kernel:
        out["kernel_chain_ratio"] = {str(k): round(s / t1, 3) for k, s in kernel.items()}
    for row in rows:
        p = row["params"] or {}
        drafter = p.get("drafter", "auto")
        if p.get("mode") != "chain" or not row["acceptance_length"]:
            continue
        k = p["draft_tokens"]
        if drafter == "mlx-eager" and "mtp_step_eager_s" in costs:
            drafts = k * costs["mtp_step_eager_s"]
        elif drafter == "auto" and kernel:
            if k not in kernel:
                continue
            drafts = kernel[k]
        elif drafter == "auto" or (drafter == "mlx" and costs.get("drafter") == "cuda"):
            drafts = k * costs["mtp_step_s"]
        else:
            continue  # the cost model times the default chain drafter, the MLX heads and the kernel
        step = drafts + v.get(k + 1, t1)
        predicted = row["acceptance_length"] * t1 / step
        measured = row["decode_speedup"]
        entry = {
            "mode": row["mode"],
            "predicted_speedup": round(predicted, 3),
            "measured_speedup": measured,
            "efficiency": round(measured / predicted, 3) if measured else None,
        }
        tot = (totals or {}).get(row["mode"])
        if tot is not None and tot.steps:
            measured_step = tot.decode_seconds / tot.steps
            entry["step_ms"] = round(measured_step * 1e3, 3)
            entry["forwards_ms"] = round(step * 1e3, 3)
            entry["overhead_share"] = round(max(measured_step - step, 0.0) / measured_step, 3)
        out["predicted"].append(entry)
    return out


BATCHED_K = 3
"""Drafts of the batched chain and the most of ``auto`` in the batch throughput runs."""


def batch_throughput(engine, prompts, max_tokens: int, sizes: list[int], log=lambda m: None) -> list[dict]:
    """Tokens/s over the whole prompt set at each batch size, as jobs decode
    it: plain batching, the batched chain (K = `BATCHED_K`) and ``auto``
    (at most K drafts a step), each after an untimed warm-up (a few tokens
    of one batch: the first batch of a size meets new shapes, and on a GPU
    new kernels to compile). The dataset suite (``--suite dataset``) adds
    rounds, projections and the single-sequence reference."""
    out = []
    for size in sizes:
        plain_tps = None
        for name, k, auto in (("", 0, False), (f"-chain-k{BATCHED_K}", BATCHED_K, False),
                              (f"-auto-k{BATCHED_K}", BATCHED_K, True)):
            mode = f"batch-b{size}{name}"
            try:
                run_batched(engine, prompts[:size], min(max_tokens, 8), size, k, auto=auto)
                run = run_batched(engine, prompts, max_tokens, size, k, auto=auto)
            except RuntimeError as e:  # a backend failure at one size loses only that size
                out.append({"mode": mode, "tokens_per_s": None, "error": f"{type(e).__name__}: {e}"})
                continue
            tps = run.tokens / run.seconds
            plain_tps = plain_tps or tps
            out.append({"mode": mode, "tokens_per_s": round(tps, 2), "tokens": run.tokens,
                        "speedup_over_plain_batching": round(tps / plain_tps, 3)})
            log(f"  {mode}: {tps:.1f} tok/s ({tps / plain_tps:.2f}x plain batching)")
    return out


def add_fast_path_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fast-path", action="append", default=[], metavar="NAME=VALUE",
                        help="set an engine fast path (repeatable), e.g. compile_layers=off, "
                        "rowwise_linears=on, cpp_drafter_on_gpu=on (docs/BACKENDS.md)")


def engine_options(args: argparse.Namespace) -> EngineOptions:
    """The fast-path switches of ``--fast-path``, over the environment's;
    a bad one ends the process with the reason and exit status 2."""
    try:
        return EngineOptions.from_env(**dict(EngineOptions.parse_switch(t) for t in args.fast_path))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def load_engine(model: str, dtype: str | None, options: EngineOptions) -> MTPEngine:
    """The engine for a command-line tool; a bad folder or dtype ends the
    process with the reason and exit status 2, not a traceback."""
    try:
        return MTPEngine.load(model, dtype=dtype, options=options)
    except (OSError, ValueError) as e:  # missing folder, bad checkpoint or dtype
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def read_prompts(engine, path: str, limit: int, context: int | None) -> list[list[int]]:
    rows = [orjson.loads(line) for line in Path(path).read_bytes().splitlines() if line.strip()]
    prompts = [engine.encode(r["prompt"]) for r in rows[:limit]]
    if context:
        # Pad each prompt with earlier held-out text up to `context` tokens.
        filler = [t for r in rows for t in engine.encode(r["prompt"] + r.get("reference", ""))]
        filler = filler * (context // max(len(filler), 1) + 1)
        prompts = [(filler[: context - len(p)] + p) if len(p) < context else p[-context:] for p in prompts]
    return prompts


def print_table(report: dict, log) -> None:
    loops = report.get("loops") or {}
    if loops:
        log(f"{loops['prompts'] - loops['loop_free_prompts']} of {loops['prompts']} plain outputs end in a repeating "
            "loop; 'no-loop x' is the speedup over the other prompts")
    log(f"{'mode':<18}{'tok/s':>9}{'speedup':>9}{'no-loop x':>10}{'dec tok/s':>10}{'dec x':>7}{'accept':>8}"
        f"{'ident':>7}{'draft%':>8}{'verify%':>8}{'peakGB':>8}")
    for r in report["results"]:
        al = f"{r['acceptance_length']:.2f}" if r["acceptance_length"] else "-"
        ds = f"{100 * r['draft_share']:.0f}" if r["draft_share"] is not None else "-"
        vs = f"{100 * r['verify_share']:.0f}" if r["verify_share"] is not None else "-"
        dt = f"{r['decode_tokens_per_s']:.1f}" if r["decode_tokens_per_s"] else "-"
        dx = f"{r['decode_speedup']:.2f}" if r["decode_speedup"] else "-"
        lf = f"{r['speedup_loop_free']:.2f}" if r.get("speedup_loop_free") else "-"
        log(f"{r['mode']:<18}{r['tokens_per_s']:>9.1f}{r['speedup'] or 0:>9.2f}{lf:>10}{dt:>10}{dx:>7}{al:>8}"
            f"{'yes' if r['identical'] else 'NO':>7}{ds:>8}{vs:>8}{r['peak_memory_gb']:>8.2f}")
    cm = report.get("cost_model")
    if cm:
        log(f"cost model: forward(T)/forward(1) = {cm['forward_ratio']}, MTP step = {cm['mtp_step_ratio']} x forward(1) ({cm.get('chain_drafter', 'mlx')} drafter)"
            + (f", {cm['mtp_step_eager_ratio']} with the eager MLX head" if "mtp_step_eager_ratio" in cm else "")
            + (f", chain kernel (K drafts)/forward(1) = {cm['kernel_chain_ratio']}" if "kernel_chain_ratio" in cm else "")
            + f", forward(1) = {cm['forward_1_ms']} ms")
        for p in cm["predicted"]:
            extra = f", step {p['step_ms']} ms of which forwards {p['forwards_ms']} ms, overhead {100 * p['overhead_share']:.0f}%" if "step_ms" in p else ""
            log(f"  {p['mode']}: predicted {p['predicted_speedup']}x, measured {p['measured_speedup']}x, efficiency {p['efficiency']}{extra}")
    for b in report.get("dataset_throughput", []):
        log(f"dataset throughput {b['mode']}: " + (f"{b['tokens_per_s']} tok/s" if b["tokens_per_s"] else b["error"]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mtp_engine.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--prompts", default=DEFAULT_PROMPTS)
    parser.add_argument("--limit", type=int, default=12, help="prompts to time")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES), choices=list(MODE_SPECS))
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds over the prompts")
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 8, 16, 32])
    parser.add_argument("--context", type=int, default=None, help="pad prompts to this many tokens")
    parser.add_argument("--synthetic", choices=list(SYNTHETIC), help="random 4-bit model of these shapes")
    parser.add_argument("--dtype", default=None, help="cast weights (float32, bfloat16, float16)")
    parser.add_argument("--contexts", type=int, nargs="*", help="repeat the suite at these context lengths")
    parser.add_argument("--batch-limit", type=int, default=None, help="prompts for batch throughput (default --limit)")
    parser.add_argument("--time-budget", type=float, default=None, help="seconds; later contexts are skipped past it")
    parser.add_argument("--json", help="write the report here")
    add_fast_path_option(parser)
    parser.add_argument("--suite", choices=["single", "dataset", "sampling", "host-cost", "prefill-cost"],
                        default="single",
                        help="single: every mode one prompt at a time; dataset: throughput over the prompt set "
                        "(plain, single-sequence chain, plain batching and batched speculation at each batch size); "
                        "sampling: plain sampling against chains under both samplers at each --temperatures; "
                        "host-cost: one forward per --widths split into Python building it, handing it to the "
                        "backend and the device, with its primitives counted (use --fast-path layer_dispatch=off); "
                        "prefill-cost: one prompt's prefill and the trunk's pieces alone over its length")
    parser.add_argument("--block-rows", type=int, nargs="+", default=[8, 16, 32, 64],
                        help="prefill-cost suite: rows per block of the grouped expert products")
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 4, 7],
                        help="host-cost suite: forward widths (1: a decoding step; K+1: a verify forward)")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0], help="sampling suite")
    parser.add_argument("--sampling-k", type=int, nargs="+", default=[2, 3, 4], help="sampling suite: chain K")
    parser.add_argument("--draft-tokens", type=int, nargs="+", default=[1, 2, 3, 4],
                        help="dataset suite: K of batched speculation")
    parser.add_argument("--auto-k", type=int, nargs="*", default=[3],
                        help="dataset suite: mode auto at each batch size, at most this many drafts a step")
    parser.add_argument("--single-k", type=int, nargs="+", default=[4],
                        help="dataset suite: K of the single-sequence chain (one run each)")
    parser.add_argument("--single-rounds", type=int, default=0,
                        help="dataset suite: time plain decoding and the --single-k chains again over N rounds, "
                        "interleaved prompt by prompt, so a drifting host speed falls on every mode alike (0: one "
                        "pass each, one mode after another)")
    parser.add_argument("--batch-rounds", type=int, default=1,
                        help="dataset suite: time the batched runs N times, each round starting one mode later and "
                        "drawing projected acceptances of its own; each row sums its rounds, and every round's outputs "
                        "are compared with the reference")
    parser.add_argument("--single-limit", type=int, default=None,
                        help="dataset suite: time one-at-a-time decoding on the first N prompts only (slow models)")
    parser.add_argument("--phase-times", action="store_true",
                        help="dataset suite: time each phase of batched runs (prefill, head prefill, join, draft, "
                        "verify, head commit, leave), synchronizing after each (slower: for finding where time goes)")
    parser.add_argument("--acceptance-profile", default=None,
                        help="dataset suite: project drafts at this cumulative profile, e.g. 0.93,0.82,0.64 "
                        "(random-weight models)")
    parser.add_argument("--loop-free", action="store_true",
                        help="dataset suite: time only the prompts whose plain output does not end in a loop")
    parser.add_argument("--mlx-lm-batch", action=argparse.BooleanOptionalAction, default=True,
                        help="dataset suite: also time mlx-lm's BatchGenerator")
    args = parser.parse_args(argv)
    if args.single_rounds < 0:
        parser.error(f"--single-rounds must be 0 or more, got {args.single_rounds}")
    if args.batch_rounds < 1:
        parser.error(f"--batch-rounds must be 1 or more, got {args.batch_rounds}")
    if any(w < 1 for w in args.widths):
        parser.error(f"--widths must be positive, got {' '.join(map(str, args.widths))}")
    if any(r < 1 for r in args.block_rows):
        parser.error(f"--block-rows must be positive, got {' '.join(map(str, args.block_rows))}")
    log = lambda m: print(m, flush=True)

    if args.synthetic:

        engine = MTPEngine(random_quantized_checkpoint(SYNTHETIC[args.synthetic](), options=engine_options(args)))
        model_name = f"synthetic {args.synthetic} (random 4-bit weights)"
    else:
        engine = load_engine(args.model, args.dtype, engine_options(args))
        model_name = args.model
    started = time.perf_counter()
    compiled = any(isinstance(layer, CompiledDecoderLayer) for layer in engine.model.layers)
    rowwise = any(isinstance(m, RowwiseLinear) for _, m in engine.model.named_modules())
    report = {"model": model_name, "machine": machine_info(), "compiled_layers": compiled,
              "rowwise_linears": rowwise,
              "fast_paths": [status.line() for status in engine.fast_paths],
              "recurrence": recurrence_path(engine.model), "runs": []}
    log(f"{model_name} on {report['machine']['device']}"
        + (f", BLAS: {report['machine']['blas']}" if "blas" in report["machine"] else "")
        + f", recurrence: {report['recurrence']}, row-by-row few-row products: {'on' if rowwise else 'off'}")
    for i, context in enumerate(args.contexts or [args.context]):
        if args.time_budget and time.perf_counter() - started > args.time_budget:
            log(f"time budget spent; skipping context {context}")
            continue
        if args.suite == "dataset":
            args.context = context
            prompts = read_prompts(engine, args.prompts, args.limit, context)
            run = dataset_suite(engine, prompts, args, log)
            print_dataset_table(run, log)
        elif args.suite == "host-cost":
            run = host_cost_suite(engine, read_prompts(engine, args.prompts, 1, context)[0], args.widths)
            print_host_cost_table(run, log)
        elif args.suite == "prefill-cost":
            run = prefill_cost_suite(engine, read_prompts(engine, args.prompts, 1, context)[0], args.block_rows)
            print_prefill_cost_table(run, log)
        elif args.suite == "sampling":
            run = sampling_suite(engine, read_prompts(engine, args.prompts, args.limit, context), args, log)
            print_sampling_table(run, log)
        else:
            run = suite(engine, args, context, log, first=i == 0)
            print_table(run, log)
        report["runs"].append(run)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(_flat(report), indent=2))
    return 0


def _flat(report: dict) -> dict:
    """One context: results, cost_model, settings and dataset_throughput at
    the top level; several: a "runs" list of those."""
    if len(report["runs"]) != 1:
        return report
    return {k: v for k, v in report.items() if k != "runs"} | report["runs"][0]


LONG_CONTEXT_MODES = ("baseline", "chain-k3", "tree-k3")


def sampling_specs(temperature: float, ks: list[int]) -> dict:
    """Plain sampling and chains under both samplers at one temperature."""
    specs = {f"plain T={temperature}": dict(mode="baseline", temperature=temperature)}
    for sampler in ("exact", "rejection"):
        for k in ks:
            specs[f"{sampler} K={k} T={temperature}"] = dict(mode="chain", draft_tokens=k, temperature=temperature,
                                                             sampler=sampler)
    return specs


def sampling_suite(engine, prompts: list[list[int]], args, log) -> dict:
    """Sampled decoding side by side: at each temperature, plain sampling
    and chains under the exact and rejection samplers (prompt ``i`` samples
    with seed ``i`` in every mode). The exact sampler's tokens must equal
    plain sampling's; the rejection sampler's differ (lossless in
    distribution only)."""
    rows, loops = [], {}
    for n, temperature in enumerate(args.temperatures):
        specs = sampling_specs(temperature, args.sampling_k)
        plain = next(iter(specs))
        log(f"sampling at T={temperature}: {len(prompts)} prompts x {args.max_tokens} tokens")
        totals = run_modes(engine, prompts, list(specs), args.max_tokens, args.rounds, log, warmup=n == 0,
                           specs=specs, reference=plain)
        free = loop_free(totals, plain)
        loops[str(temperature)] = {k: v for k, v in free.items() if k != "speedup"}
        for name, tot in totals.items():
            row = tot.row(totals[plain])
            spec = specs[name]
            row.update(temperature=temperature, sampler=spec.get("sampler", "plain"),
                       draft_tokens=spec.get("draft_tokens", 0), speedup_loop_free=free.get("speedup", {}).get(name))
            if row["sampler"] == "rejection":
                row["identical"] = None  # equal in distribution, not token for token
            rows.append(row)
    return {"settings": {"prompts": len(prompts), "max_tokens": args.max_tokens, "rounds": args.rounds,
                         "temperatures": args.temperatures}, "loops": loops, "results": rows}


def print_sampling_table(report: dict, log) -> None:
    for t, loops in report["loops"].items():
        log(f"T={t}: {loops['prompts'] - loops['loop_free_prompts']} of {loops['prompts']} plain samples end in a "
            "repeating loop")
    log(f"{'mode':<22}{'tok/s':>9}{'speedup':>9}{'no-loop x':>10}{'accept':>8}{'same tokens':>12}")
    for r in report["results"]:
        al = f"{r['acceptance_length']:.2f}" if r["acceptance_length"] else "-"
        lf = f"{r['speedup_loop_free']:.2f}" if r.get("speedup_loop_free") else "-"
        same = "n/a" if r["identical"] is None else ("yes" if r["identical"] else "NO")
        log(f"{r['mode']:<22}{r['tokens_per_s']:>9.1f}{r['speedup'] or 0:>9.2f}{lf:>10}{al:>8}{same:>12}")


def suite(engine, args, context: int | None, log, first: bool = True) -> dict:
    """One side-by-side run at one context length. After the first context,
    only `LONG_CONTEXT_MODES`, one prompt, no batch throughput (each run
    there is dominated by prefilling the context)."""
    modes = args.modes if first else [m for m in args.modes if m in LONG_CONTEXT_MODES]
    limit = args.limit if first else 1
    prompts = read_prompts(engine, args.prompts, limit, context)
    log(f"context {context or 'prompt only'}: {len(prompts)} prompts x {args.max_tokens} tokens")
    totals = run_modes(engine, prompts, modes, args.max_tokens, args.rounds, log, warmup=first)
    rows = [t.row(totals.get("baseline")) for t in totals.values()]
    if "baseline" in totals:
        free = loop_free(totals, "baseline")
        for row in rows:
            row["speedup_loop_free"] = free.get("speedup", {}).get(row["mode"])
    # Every verify width a timed chain mode feeds (K + 1), and at least 1..8.
    depths = [MODE_SPECS[m]["draft_tokens"] for m in modes if MODE_SPECS[m] and "draft_tokens" in MODE_SPECS[m]]
    costs = forward_costs(engine, prompts[0], list(range(1, max([7, *depths]) + 2)))
    report = {
        "settings": {"prompts": len(prompts), "max_tokens": args.max_tokens, "rounds": args.rounds, "context": context},
        "loops": {k: v for k, v in loop_free(totals, "baseline").items() if k != "speedup"} if "baseline" in totals
        else None,
        "results": rows,
        "cost_model": cost_model(costs, rows, totals),
    }
    if args.batch_sizes and first:
        limit = args.batch_limit or args.limit
        # A dataset's own prompts, unpadded: the throughput a job over them sees.
        batch_prompts = read_prompts(engine, args.prompts, limit, None)
        log(f"batched: {len(batch_prompts)} prompts at batch sizes {', '.join(map(str, args.batch_sizes))}")
        report["dataset_throughput"] = batch_throughput(engine, batch_prompts, args.max_tokens, args.batch_sizes, log)
        report["dataset_throughput"] += [
            {"mode": r["mode"], "tokens_per_s": r["tokens_per_s"], "note": "one row at a time"} for r in rows
        ]
    return report




if __name__ == "__main__":
    raise SystemExit(main())

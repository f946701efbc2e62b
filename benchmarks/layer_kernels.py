"""Which part of a verify forward launches the kernels that a one-token
forward does not.

    python benchmarks/layer_kernels.py [--model DIR] [--widths 1 7]

On a GPU a speculative step is bound by kernel launches, so a verify
forward over K+1 tokens costs more than one token chiefly by the kernels it
adds. This probe counts, under PyTorch's profiler (the GPU image), the
kernels of each part of the trunk at each width, by kernel name: one
gated-delta layer's mixer (per-token checkpoints on), one attention
layer's mixer, one MoE block (the engine's and mlx-lm's), a norm, the LM head with the greedy choice,
the whole verify forward, and the commit of an accepted prefix. The report
gives each part's kernels per width and the names whose counts grow.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import mlx.core as mx
from mlx_lm.models.qwen3_next import Qwen3NextSparseMoeBlock

from mtp_engine.backend import prefer_mlx_attention
from mtp_engine.bench import DEFAULT_MODEL, prefilled_caches
from mtp_engine.cache_ops import commit_verified_prefix
from mtp_engine.engine import MTPEngine, greedy_tokens
from mtp_engine.recurrent import CheckpointArraysCache


def kernel_names(fn, repeats: int) -> Counter:
    """Kernel launches of ``fn()`` (which evaluates what it builds), by
    name, per call."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm-up: kernels, graphs
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
    names = Counter(e.name[:100] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return Counter({n: c / repeats for n, c in names.items()})


def parts(engine: MTPEngine, caches: list, width: int) -> dict:
    """Callables that build and evaluate each part at ``width`` tokens and
    leave the caches as they found them."""
    model = engine.model
    layers = model.model.layers
    gdn = next(i for i, layer in enumerate(layers) if layer.is_linear)
    attn = next(i for i, layer in enumerate(layers) if not layer.is_linear)
    dim = model.args.hidden_size
    x = mx.random.normal((1, width, dim)).astype(layers[0].input_layernorm.weight.dtype)
    tokens = mx.array([[7] * width])
    mx.eval(x)

    def rewind():
        for c in caches:
            if c.is_trimmable():
                c.trim(c.offset - base)
            else:
                c.clear_checkpoints()

    base = caches[attn].offset

    def capture():
        for c in caches:
            if isinstance(c, CheckpointArraysCache):
                c.begin_capture()

    def gdn_mixer():
        capture()
        out = layers[gdn].linear_attn(x, None, caches[gdn])
        mx.eval(out, list(caches[gdn].checkpoints) if caches[gdn].checkpoints else [])
        rewind()

    def attn_mixer():
        mx.eval(layers[attn].self_attn(x, "causal" if width > 1 else None, caches[attn]))
        rewind()

    def verify():
        capture()
        logits = engine.lm_head(model.model(tokens, cache=caches))
        mx.eval(greedy_tokens(logits), [c.state for c in caches])
        rewind()

    def verify_and_commit():
        capture()
        logits = engine.lm_head(model.model(tokens, cache=caches))
        mx.eval(greedy_tokens(logits))
        commit_verified_prefix(caches, width, max(width // 2, 1))
        mx.eval([c.state for c in caches])
        rewind()  # the recurrent states stay advanced: their shapes, not values, matter here

    return {
        "gdn mixer": gdn_mixer,
        "attention mixer": attn_mixer,
        "moe block": lambda: mx.eval(layers[0].mlp(x)),
        # mlx-lm's own block on the same weights (strided routing indices)
        "moe block (mlx-lm)": lambda: mx.eval(Qwen3NextSparseMoeBlock.__call__(layers[0].mlp, x)),
        "rms norm": lambda: mx.eval(layers[0].input_layernorm(x)),
        "lm head + greedy": lambda: mx.eval(greedy_tokens(engine.lm_head(x))),
        "verify forward": verify,
        "verify + commit": verify_and_commit,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 7])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    prefer_mlx_attention()
    engine = MTPEngine.load(args.model)
    caches = prefilled_caches(engine, [(7 * i) % 1000 + 3 for i in range(args.context)])
    counts = {w: {name: kernel_names(fn, args.repeats) for name, fn in parts(engine, caches, w).items()}
              for w in args.widths}
    first, last = args.widths[0], args.widths[-1]
    report = {}
    for name in counts[first]:
        a, b = counts[first][name], counts[last][name]
        grown = {n: round(b[n] - a[n], 2) for n in set(a) | set(b) if b[n] != a[n]}
        report[name] = {
            "kernels": {w: round(sum(counts[w][name].values()), 1) for w in args.widths},
            "grown": dict(sorted(grown.items(), key=lambda kv: -abs(kv[1]))),
            f"names at {last}": dict(counts[last][name].most_common()),
        }
        print(f"{name}: kernels {report[name]['kernels']}")
        for n, d in report[name]["grown"].items():
            print(f"    {d:+6.1f}  {n}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

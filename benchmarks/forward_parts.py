"""Where a verify forward's growth with T goes on the 80B-A3B shapes (a
probe): the whole verify forward against its parts run alone, interleaved
repeat by repeat after a prefill of ``--context`` tokens:

- the 48 MoE blocks (router, routed experts through ``gather_qmm``, shared
  expert), and their graph building alone;
- the 36 gated-delta mixers with checkpoints on (projections, conv, the CUDA
  recurrence kernel, gated norm), their caches restored after each pass;
- the 12 attention mixers over the context (trimmed after each pass);
- the 36 depthwise convs alone;
- the gated-delta mixer's pieces, each for the 36 layers: the input
  projections, the recurrence keeping every token's state (the CUDA kernel
  there), the per-token conv windows, the gated norm with ``out_proj``.

On a freshly started GPU machine MLX compiles its kernels on first use; the
first (unmeasured) pass takes minutes on these shapes.

    python benchmarks/forward_parts.py [--context 1024] [--repeats 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
from mlx_lm.models.gated_delta import normalize_qk

from mtp_engine.backend import prefer_mlx_attention
from mtp_engine.bench import prefilled_caches, verify_forward
from mtp_engine.engine import MTPEngine
from mtp_engine.recurrent import ConvWindows, _recurrence  # the engine's recurrence as a verify forward runs it
from mtp_engine.synthetic import qwen3_next_80b_config, random_quantized_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    prefer_mlx_attention()
    checkpoint = random_quantized_checkpoint(qwen3_next_80b_config())
    engine = MTPEngine(checkpoint)
    model = engine.model
    caches = prefilled_caches(engine, [(7 * i) % 1000 + 3 for i in range(args.context)])
    layers = model.model.layers
    dim = checkpoint.config["hidden_size"]
    widths = [1, 2, 4, 5, 8]
    xs = {w: mx.random.normal((1, w, dim)).astype(mx.bfloat16) for w in widths}
    mx.eval(list(xs.values()))

    def moe(w):
        x = xs[w]
        outs = [layer.mlp(x) for layer in layers]
        mx.eval(outs)

    def host_moe(w):  # graph building only
        x = xs[w]
        return [layer.mlp(x) for layer in layers]

    linear = [(layer.linear_attn, caches[i]) for i, layer in enumerate(layers) if layer.is_linear]
    attention = [(layer.self_attn, caches[i]) for i, layer in enumerate(layers) if not layer.is_linear]

    def gated_delta(w):  # the 36 gated-delta mixers, checkpoints on, then rolled back
        x = xs[w]
        saved = [(c[0], c[1]) for _, c in linear]
        outs = []
        for m, c in linear:
            c.begin_capture()
            outs.append(m(x, None, c))
        mx.eval(outs, [list(c.checkpoints) for _, c in linear])  # every token's checkpoint, built
        for (_, c), (conv, state) in zip(linear, saved):
            c[0], c[1] = conv, state
            c.clear_checkpoints()

    def attend(w):  # the 12 attention mixers over the context, then trimmed
        x = xs[w]
        outs = [m(x, mask="causal" if w > 1 else None, cache=c) for m, c in attention]
        mx.eval(outs)
        for _, c in attention:
            c.trim(w)

    conv_in = {w: mx.random.normal((1, w + 3, linear[0][0].conv_dim)).astype(mx.bfloat16) for w in widths}

    def conv(w):
        mx.eval([m.conv1d(conv_in[w]) for m, _ in linear])

    # The gated-delta mixer's pieces, each for the 36 layers.
    m0 = linear[0][0]
    Hk, Dk, Hv, Dv = m0.num_k_heads, m0.head_k_dim, m0.num_v_heads, m0.head_v_dim

    def normal(shape):
        return mx.random.normal(shape).astype(mx.bfloat16)

    rec_in = {}
    for w in widths:
        q, k = normal((1, w, Hk, Dk)), normal((1, w, Hk, Dk))
        q, k = normalize_qk(q, k, inv_scale=Dk**-0.5, eps=1e-6)
        rec_in[w] = (q, k, normal((1, w, Hv, Dv)), normal((1, w, Hv)), normal((1, w, Hv)), normal((1, w, Hv * Dv)))
    mx.eval(list(rec_in.values()))

    def projections(w):
        mx.eval([(m.in_proj_qkvz(xs[w]), m.in_proj_ba(xs[w])) for m, _ in linear])

    def recurrences(w):  # the recurrence with every token's state kept, from each layer's state
        q, k, v, a, b, _ = rec_in[w]
        mx.eval([_recurrence(m, q, k, v, a, b, c[1], None, True) for m, c in linear])

    def conv_windows(w):  # every token's conv window (verify forwards built them all before lazy checkpoints)
        mx.eval([list(ConvWindows(conv_in[w], 3)) for _ in linear])

    def output(w):  # gated norm and out_proj
        _, _, v, _, _, z = rec_in[w]
        mx.eval([m.out_proj(m.norm(v, z.reshape(v.shape)).reshape(1, w, -1)) for m, _ in linear])

    parts = {"verify forward": lambda w: verify_forward(engine, caches, w), "48 MoE blocks": moe,
             "36 gated-delta mixers": gated_delta, "12 attention mixers": attend, "36 conv1d": conv,
             "36 in_proj_qkvz + in_proj_ba": projections, "36 recurrences (states kept)": recurrences,
             "36 x T conv windows": conv_windows, "36 gated norms + out_proj": output}
    times = {(p, w): [] for p in parts for w in widths}
    build = {w: [] for w in widths}
    for rep in range(args.repeats + 1):
        for w in widths:
            for p, fn in parts.items():
                t = time.perf_counter()
                fn(w)
                if rep:
                    times[(p, w)].append(time.perf_counter() - t)
            t = time.perf_counter()
            outs = host_moe(w)
            if rep:
                build[w].append(time.perf_counter() - t)
            mx.eval(outs)
    report = {}
    for p in parts:
        med = {w: statistics.median(times[(p, w)]) for w in widths}
        report[p] = {"ms": {w: round(1e3 * med[w], 2) for w in widths},
                     "ratio": {w: round(med[w] / med[1], 3) for w in widths}}
    report["48 MoE blocks: graph building"] = {"ms": {w: round(1e3 * statistics.median(build[w]), 2) for w in widths}}
    print(json.dumps(report, indent=1), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()

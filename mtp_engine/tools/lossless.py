"""Check the lossless contract on this machine: every decoding mode against
mlx-lm's own greedy decoding of the same model, token for token.

``python -m mtp_engine.lossless`` decodes held-out prompts with mlx-lm's
``generate_step`` (the reference) and with each mode of the engine. An output
that differs from the reference passes only if its first divergence sits on a
numerical near-tie: a position where the reference's top-2 log-probabilities
are closer than float arithmetic can separate. A verify forward over K+1
tokens and a one-token forward add in different orders, so on a near-tie
they may pick different tokens; anything else is a bug. The exit status is 1
when a divergence is not a near-tie.

Two tests make a divergence a near-tie; either suffices:

- the bound: the reference's top-2 gap is under ``1e-4`` in float32, or under
  ``--half-ulps`` units in the last place of the top logit (default 4) when
  the model computes in bfloat16 or float16, whose logits near 10 are spaced
  0.0625 (bfloat16) apart;
- the measured noise: the two decodings' logits for the same token at the
  same position, before the divergence, differ by up to ``noise`` (the
  arithmetic gap between a verify forward and a one-token forward on this
  machine, measured on this very output). The flip between reference token
  ``a`` and engine token ``b`` needs the two logits to move apart by
  ``gap + engine_gap`` (the reference's lead of ``a`` over ``b`` plus the
  engine's lead of ``b`` over ``a``); it is explained when that is at most
  ``2 * noise`` and the noise itself is arithmetic-sized (at most
  ``NOISE_CAP`` near-tie bounds; a wrong commit shifts logits by whole units).
  Bit-identical passes measure a noise of 0, so there any divergence fails.

The engine's own plain decoding (``baseline``, one token per forward) runs
too. Where its one-token arithmetic is not mlx-lm's (on CUDA the engine's
recurrence kernel runs one-token decoding as well), a mode can differ from
the reference exactly where plain decoding does. Such a divergence is
explained by plain decoding when the mode's whole output equals the
engine's plain decoding and the reference's top-2 gap there is within
``NOISE_CAP`` near-tie bounds (a broken kernel moves logits by whole
units): speculation then lost nothing against one-token decoding with the
same kernels. The report counts the outputs identical to the engine's plain
decoding next to those identical to the reference.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step

from mtp_engine.engine import MTPEngine
from mtp_engine.kernels import cpu_blas
from mtp_engine.sampling import top_logits
from mtp_engine.tools.bench import (
    DEFAULT_MODEL,
    DEFAULT_MODES,
    DEFAULT_PROMPTS,
    MODE_SPECS,
    add_fast_path_option,
    engine_options,
    load_engine,
    read_prompts,
)

FLOAT32_NEAR_TIE = 1e-4
# Noise above this many near-tie bounds is not arithmetic: a wrong cache
# commit moves logits by whole units long before it changes a token.
NOISE_CAP = 4
MANTISSA_BITS = {mx.bfloat16: 7, mx.float16: 10, mx.float32: 23}
# The benchmark's speculative modes (baseline is what they are checked against).
MODES = {name: MODE_SPECS[name] for name in DEFAULT_MODES if MODE_SPECS[name] and MODE_SPECS[name]["mode"] != "baseline"}


TopLogits = list[tuple[int, float]]  # the highest (token, logit) pairs, best first


@dataclass
class Reference:
    tokens: list[int]
    gaps: list[float]  # top-2 log-probability gap per position
    bounds: list[float]  # near-tie bound per position
    tops: list[TopLogits]  # per position


@dataclass
class Divergence:
    prompt: int
    mode: str
    position: int
    token: int
    reference_token: int
    gap: float
    bound: float
    engine_gap: float | None = None  # the engine's lead of its token over the reference's
    noise: float | None = None  # largest logit difference on shared tokens before ``position``
    same_as_plain: bool = False  # the mode's output equals the engine's plain decoding

    @property
    def explained_by_noise(self) -> bool:
        if self.engine_gap is None or self.noise is None or self.noise > NOISE_CAP * self.bound:
            return False
        return self.gap + self.engine_gap <= 2 * self.noise

    @property
    def explained_by_plain(self) -> bool:
        return self.same_as_plain and self.gap <= NOISE_CAP * self.bound

    @property
    def near_tie(self) -> bool:
        return self.gap < self.bound or self.explained_by_noise or self.explained_by_plain


@dataclass
class Report:
    compared: int = 0
    identical: int = 0
    identical_to_plain: int = 0  # outputs equal to the engine's own plain decoding
    divergences: list[Divergence] = field(default_factory=list)

    @property
    def failures(self) -> list[Divergence]:
        return [d for d in self.divergences if not d.near_tie]


def near_tie_bound(top_logit: float, dtype, half_ulps: float) -> float:
    """The smallest top-2 gap float arithmetic at ``dtype`` reliably separates."""
    if dtype == mx.float32:
        return FLOAT32_NEAR_TIE
    bits = MANTISSA_BITS.get(dtype, 7)
    exponent = math.floor(math.log2(max(abs(top_logit), 1e-6)))
    return half_ulps * 2.0 ** (exponent - bits)


def reference(engine: MTPEngine, ids: list[int], n: int, half_ulps: float) -> Reference:
    """mlx-lm's greedy decoding of the engine's model, with per-position gaps."""
    raw: list[mx.array] = []

    # generate_step hands out log-probabilities; the bound needs the raw
    # top logit and the precision the logits were computed in.
    def keep_logits(_, logits):
        raw.append(logits)
        return logits

    ref = Reference([], [], [], [])
    steps = generate_step(mx.array(ids), engine.model, max_tokens=n, logits_processors=[keep_logits])
    for token, logprobs in steps:
        top2 = mx.sort(logprobs)[-2:]
        logits = raw[len(ref.tokens)]
        ref.tops.append(top_logits(logits.reshape(1, -1))[0])
        ref.tokens.append(int(token))
        ref.gaps.append(float(top2[1] - top2[0]))
        ref.bounds.append(near_tie_bound(ref.tops[-1][0][1], logits.dtype, half_ulps))
        if ref.tokens[-1] in engine.eos_token_ids:
            break
    return ref


def engine_tops(trace) -> list[TopLogits | None]:
    """Per generated position, the engine's top logits (None for the first
    token, which the prompt's forward picks, as the reference's does)."""
    tops: list[TopLogits | None] = [None]
    for step in trace:
        tops += step.top_logits
    return tops


def measure_noise(ref: Reference, tops: list[TopLogits | None], position: int,
                  token: int) -> tuple[float | None, float]:
    """``(engine_gap, noise)`` for a divergence at ``position`` to ``token``.

    ``noise`` is the largest difference between the engine's and the
    reference's logit for the same token at an earlier position;
    ``engine_gap`` the engine's lead of ``token`` over the reference's token
    at ``position`` (None when that token is not among the engine's top
    logits there, i.e. the engine is far from a tie)."""
    noise = 0.0
    for t in range(min(position, len(tops))):
        if tops[t] is None:
            continue
        mine = dict(tops[t])
        for k, v in ref.tops[t]:
            if k in mine:
                noise = max(noise, abs(v - mine[k]))
    here = dict(tops[position]) if position < len(tops) and tops[position] is not None else {}
    theirs = ref.tokens[position]
    if token not in here or theirs not in here:
        return None, noise
    return here[token] - here[theirs], noise


def first_divergence(tokens: list[int], ref: Reference) -> int | None:
    """The first position where ``tokens`` and the reference differ."""
    return next((i for i, (a, b) in enumerate(zip(tokens, ref.tokens)) if a != b), None)


def check(engine: MTPEngine, prompts: list[list[int]], modes: list[str], max_tokens: int,
          half_ulps: float = 4.0, log=print, after_prompt=None) -> Report:
    """Every mode on every prompt against the reference; ``after_prompt(report)``
    runs after each prompt (to save partial reports)."""
    report = Report()
    for p, ids in enumerate(prompts):
        ref = reference(engine, ids, max_tokens, half_ulps)
        plain = engine.generate(ids, max_tokens=max_tokens, mode="baseline").tokens
        if (i := first_divergence(plain, ref)) is not None:
            log(f"prompt {p} plain decoding: first divergence at token {i} ({plain[i]} vs reference "
                f"{ref.tokens[i]}), reference top-2 gap {ref.gaps[i]:.4g}, near-tie bound {ref.bounds[i]:.4g}")
        for name in modes:
            result = engine.generate(ids, max_tokens=max_tokens, trace=True, **MODES[name])
            report.compared += 1
            same_as_plain = result.tokens == plain
            report.identical_to_plain += same_as_plain
            i = first_divergence(result.tokens, ref)
            token = None
            if i is None:
                # Same tokens as far as both go; the engine leaves EOS out, so
                # ending early is a divergence unless the reference's next is EOS.
                n = len(result.tokens)
                if n < len(ref.tokens) and ref.tokens[n] not in engine.eos_token_ids:
                    i, token = n, -1  # -1: the engine stopped here
                else:
                    report.identical += 1
                    continue
            d = Divergence(p, name, i, result.tokens[i] if token is None else token, ref.tokens[i],
                           ref.gaps[i], ref.bounds[i], same_as_plain=same_as_plain)
            if d.token != -1:
                d.engine_gap, d.noise = measure_noise(ref, engine_tops(result.trace), i, d.token)
            report.divergences.append(d)
            got = "stop" if d.token == -1 else d.token
            measured = "" if d.noise is None else (
                f"; engine gap {'-' if d.engine_gap is None else f'{d.engine_gap:.4g}'}, "
                f"noise before it {d.noise:.4g}")
            measured += "; same output as plain decoding" if d.same_as_plain else ""
            log(f"prompt {p} {name}: first divergence at token {i} ({got} vs reference {d.reference_token}), "
                f"reference top-2 gap {d.gap:.4g} {'<' if d.gap < d.bound else '>='} near-tie bound "
                f"{d.bound:.4g}{measured}{'' if d.near_tie else '  NOT A NEAR-TIE'}")
        log(f"prompt {p + 1}/{len(prompts)} done: {report.identical}/{report.compared} identical so far")
        if after_prompt is not None:
            after_prompt(report)
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mtp_engine.lossless", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--prompts", default=DEFAULT_PROMPTS)
    parser.add_argument("--limit", type=int, default=12, help="prompts to check")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--dtype", default=None, help="cast weights (float32, bfloat16, float16)")
    parser.add_argument("--half-ulps", type=float, default=4.0,
                        help="near-tie bound for half-precision logits, in ulps of the top logit")
    add_fast_path_option(parser)
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)

    engine = load_engine(args.model, args.dtype, engine_options(args))
    prompts = read_prompts(engine, args.prompts, args.limit, None)
    dtype = engine.model.model.embed_tokens.weight.dtype
    blas = f", BLAS: {cpu_blas.active()}" if mx.default_device() == mx.cpu else ""
    print(f"{args.model} ({dtype}) on {mx.default_device()}{blas}: {len(prompts)} prompts x "
          f"{args.max_tokens} tokens x {len(args.modes)} modes", flush=True)
    def save(report: Report) -> None:
        if not args.json:
            return
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        out = {"model": args.model, "dtype": str(dtype), "device": str(mx.default_device()),
               "compared": report.compared, "identical": report.identical,
               "identical_to_plain": report.identical_to_plain,
               "divergences": [asdict(d) | {"near_tie": d.near_tie, "explained_by_noise": d.explained_by_noise,
                                            "explained_by_plain": d.explained_by_plain}
                               for d in report.divergences]}
        Path(args.json).write_text(json.dumps(out, indent=2))

    report = check(engine, prompts, args.modes, args.max_tokens, args.half_ulps,
                   log=lambda m: print(m, flush=True), after_prompt=save)
    near = len(report.divergences) - len(report.failures)
    print(f"{report.identical}/{report.compared} identical, {near} diverged on a near-tie, "
          f"{len(report.failures)} diverged elsewhere; {report.identical_to_plain}/{report.compared} "
          f"identical to the engine's plain decoding")
    return 1 if report.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())

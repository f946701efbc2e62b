"""Sampling that speculation keeps exact.

Filters (top-p, min-p, top-k, in mlx-lm's order, with mlx-lm's own
functions where they fit) shape the log-probabilities; the temperature
scales them. Two samplers:

- **exact** (the default): the token at generated position ``t`` is the
  Gumbel-max choice ``argmax(filtered_logprobs / T + g_t)``, with noise
  ``g_t`` drawn from a counter-based hash of ``(seed, t)`` only. That is a
  sample of ``softmax(filtered_logprobs / T)``. Drafts use the same noise at
  the same position on the head's log-probabilities; a draft is accepted
  when it equals the target's choice. Every mode, batch size and batch
  composition then emits exactly the tokens plain sampling emits with that
  seed (up to numerical near-ties, as in greedy decoding).
- **rejection**: standard speculative sampling. Drafts are sampled from the
  head's filtered distribution ``q``; draft ``d`` is accepted with
  probability ``min(1, p(d) / q(d))``; the first rejection samples from
  ``norm(max(0, p - q))``; a bonus token comes from ``p`` when every draft
  is accepted. Lossless in distribution (the tokens depend on K and the
  drafts, not only on the seed).

The noise is a pure function of (seed, position, vocabulary index, stream):
integer hashing in MLX ops, identical on every backend, batch shape and rank.

Penalties (`apply_penalties`) change the logits before either: at generated
position ``t`` a row's logits are penalized by the tokens it generated
before ``t`` (the prompt does not count), a repetition penalty ``r`` as
Hugging Face applies it (a seen token's logit ``l`` becomes ``l / r`` if
``l > 0``, else ``l * r``), then OpenAI's presence and frequency penalties
(``l - presence - frequency * count``). A verify forward penalizes each of
its positions by the row's tokens plus the drafts before that position, so
speculation emits what plain decoding with the same penalties emits.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, replace

import mlx.core as mx

SAMPLERS = ("exact", "rejection")

# Streams of independent noise drawn from one seed.
TARGET, DRAFT, ACCEPT, RESIDUAL = 0, 1, 2, 3


@dataclass(frozen=True)
class SamplingParams:
    """How one completion samples.

    Attributes:
        temperature: 0 is greedy decoding (the other fields are ignored).
        top_p: Nucleus filter, in (0, 1]; 1 keeps everything.
        top_k: Keep the k likeliest tokens; 0 keeps everything.
        min_p: Drop tokens under ``min_p`` times the likeliest's probability.
        seed: The completion's seed (any integer in 0..2**63-1).
        sampler: "exact" or "rejection" (see the module docstring).
        repetition_penalty: > 0; 1 is off (greedy rows use it too).
        presence_penalty, frequency_penalty: In [-2, 2]; 0 is off.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    sampler: str = "exact"
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an int in 0..2**63-1, got {self.seed!r}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}, got {self.sampler!r}")
        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {r!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def rejects(self) -> bool:
        """Samples with the rejection sampler (a greedy row never does)."""
        return self.sampler == "rejection" and not self.greedy

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    def filter_key(self) -> tuple:
        """What the filters depend on (rows sharing it filter together)."""
        return (self.top_p, self.top_k, self.min_p)


GREEDY = SamplingParams()
FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "sampler", "repetition_penalty", "presence_penalty",
          "frequency_penalty")
"""The keyword names of `SamplingParams`."""

HELP = {
    "temperature": "sampling temperature; 0 decodes greedily",
    "top_p": "nucleus filter in (0, 1]; 1 is off",
    "top_k": "keep the k likeliest tokens; 0 is off",
    "min_p": "drop tokens under min_p x the likeliest's probability; 0 is off",
    "seed": "the seed (a job's: each completion's seed derives from it, the row id and the sample index)",
    "sampler": "exact: every mode, batch size and rank writes the same tokens for a seed; rejection: "
               "speculative sampling, lossless in distribution",
    "repetition_penalty": "divide a generated token's positive logit by it (multiply a negative one); 1 is off",
    "presence_penalty": "subtract it from the logit of every token generated so far; 0 is off",
    "frequency_penalty": "subtract it times the count of each token generated so far; 0 is off",
}
"""One line per field for command lines."""


def make_sampling(temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                  seed: int | None = None, sampler: str = "exact", **penalties) -> SamplingParams:
    """Validated `SamplingParams`; an unset seed becomes a fresh random one
    (each completion its own, never a shared stream)."""
    if seed is None:
        seed = secrets.randbits(63)
    return SamplingParams(temperature, top_p, top_k, min_p, seed, sampler, **penalties)


def apply_penalties(logits: mx.array, params: list[SamplingParams], history: list[list[int]],
                    drafts: mx.array | None = None, pending: mx.array | None = None,
                    fed: list[bool] | None = None) -> mx.array:
    """``[R, T, V]`` logits with each row's penalties (module docstring):
    column ``t`` of row ``r`` is penalized by ``history[r]`` (its generated
    tokens), then, where given, ``pending[r]`` (``[R, 1]``, a token generated
    but not yet read back, for rows where ``fed[r]``) and the drafts before
    column ``t`` (``drafts``: ``[R, T - 1]``). Unpenalized rows come back
    unchanged, in the logits' dtype, as do penalized ones (so plain decoding
    and every batch round alike)."""
    if not any(p.penalized for p in params):
        return logits
    R, T, V = logits.shape
    rows = [r for r, h in enumerate(history) if params[r].penalized for _ in h]
    tokens = [t for r, h in enumerate(history) if params[r].penalized for t in h]
    counts = mx.zeros((R, 1, V), dtype=mx.float32)
    if tokens:
        counts = counts.at[mx.array(rows, dtype=mx.int32), 0, mx.array(tokens, dtype=mx.int32)].add(1.0)
    vocab = mx.arange(V, dtype=mx.int32)
    if pending is not None:
        counts = counts + ((pending[..., None] == vocab) & mx.array(fed)[:, None, None]).astype(mx.float32)
    if drafts is not None and T > 1:
        seen_before = mx.cumsum((drafts[..., None].astype(mx.int32) == vocab).astype(mx.float32), axis=1)
        counts = counts + mx.concatenate([mx.zeros((R, 1, V), dtype=mx.float32), seen_before], axis=1)
    on = mx.array([p.penalized for p in params])[:, None, None]
    counts = mx.where(on, counts, 0.0)
    seen = counts > 0
    rep = mx.array([float(p.repetition_penalty) for p in params], dtype=mx.float32)[:, None, None]
    presence = mx.array([float(p.presence_penalty) for p in params], dtype=mx.float32)[:, None, None]
    frequency = mx.array([float(p.frequency_penalty) for p in params], dtype=mx.float32)[:, None, None]
    x = logits.astype(mx.float32)
    x = mx.where(seen, mx.where(x > 0, x / rep, x * rep), x)
    x = x - mx.where(seen, presence, 0.0) - frequency * counts
    return x.astype(logits.dtype)


def filtered_logprobs(logits: mx.array, params: SamplingParams) -> mx.array:
    """Log-probabilities over the last axis with filtered tokens at -inf:
    top-p, min-p, then top-k, as mlx-lm's ``make_sampler`` applies them."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p  # here: importing mlx-lm takes ~1 s

    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    if params.top_p < 1:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p > 0:
        logprobs = apply_min_p(logprobs, params.min_p)
    if 0 < params.top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, params.top_k)
    return logprobs


def _mix(x: mx.array) -> mx.array:
    """A 32-bit integer hash with full avalanche (lowbias32)."""
    x = x ^ (x >> 16)
    x = x * mx.array(0x7FEB352D, dtype=mx.uint32)
    x = x ^ (x >> 15)
    x = x * mx.array(0x846CA68B, dtype=mx.uint32)
    return x ^ (x >> 16)


def uniforms(seeds: list[int], positions: mx.array, size: int, stream: int = TARGET) -> mx.array:
    """Uniforms in (0, 1), ``[R, T, size]``: a pure function of each row's
    seed, the positions ``[R, T]`` (int), the index along the last axis and
    the stream."""
    lo = mx.array([s & 0xFFFFFFFF for s in seeds], dtype=mx.uint32)
    hi = mx.array([s >> 32 for s in seeds], dtype=mx.uint32)
    key = _mix(lo ^ _mix(hi ^ _mix(mx.array(stream + 0x632BE5AB, dtype=mx.uint32))))  # [R]
    at = _mix(key[:, None] ^ _mix(positions.astype(mx.uint32) * mx.array(0x9E3779B9, dtype=mx.uint32)))  # [R, T]
    index = mx.arange(size, dtype=mx.uint32) * mx.array(0x85EBCA6B, dtype=mx.uint32)
    bits = _mix(at[..., None] ^ index)  # [R, T, size]
    return ((bits >> 8).astype(mx.float32) + 0.5) * (1.0 / (1 << 24))


def gumbel(seeds: list[int], positions: mx.array, size: int, stream: int = TARGET) -> mx.array:
    """Standard Gumbel noise ``-log(-log(U))`` of `uniforms`."""
    return -mx.log(-mx.log(uniforms(seeds, positions, size, stream)))


def _rows_by_filter(params: list[SamplingParams]) -> list[tuple[SamplingParams, list[int]]]:
    groups: dict[tuple, list[int]] = {}
    first: dict[tuple, SamplingParams] = {}
    for r, p in enumerate(params):
        groups.setdefault(p.filter_key(), []).append(r)
        first.setdefault(p.filter_key(), p)
    return [(first[k], rows) for k, rows in groups.items()]


MAX_LOGPROBS = 20
"""The most alternatives a token's log-probability comes with."""


def check_logprobs(value) -> int | None:
    """``value`` if it is a ``logprobs`` setting (None, or an int in
    0..`MAX_LOGPROBS`), else a ValueError naming it."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or not 0 <= value <= MAX_LOGPROBS):
        raise ValueError(f"logprobs must be an integer in 0..{MAX_LOGPROBS}, got {value!r}")
    return value


def token_logprobs(logits: mx.array, params: list[SamplingParams], tokens: list[list[int]],
                   top: list[int]) -> list[list[tuple[float, list[tuple[int, float]]]]]:
    """Each row's tokens' log-probabilities in the distribution it samples
    from before the temperature: the log-softmax of ``[R, T, V]`` logits
    (after penalties), with the row's filters applied when it samples
    (filtered tokens at -inf), and the row's ``top[r]`` likeliest tokens
    there (0 <= top <= `MAX_LOGPROBS`; fewer where the filters keep fewer). Row ``r`` gives one entry per token
    of ``tokens[r]`` (at most T), ``(logprob, [(token, logprob), ...])``."""
    R, T, V = logits.shape
    lp = logits.astype(mx.float32)
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
    if any(not p.greedy for p in params):
        filtered = scaled_logprobs(logits, [replace(p, temperature=1.0) if not p.greedy else p for p in params])
        lp = mx.where(mx.array([not p.greedy for p in params])[:, None, None], filtered, lp)
    index = mx.array([t + [0] * (T - len(t)) for t in tokens], dtype=mx.int32)
    chosen = mx.take_along_axis(lp, index[..., None], axis=-1)[..., 0]
    k = max(top)
    if k:
        best = mx.argpartition(-lp, kth=k - 1, axis=-1)[..., :k]
        best_lp = mx.take_along_axis(lp, best, axis=-1)
        mx.eval(chosen, best, best_lp)
        best, best_lp = best.tolist(), best_lp.tolist()
    chosen = chosen.tolist()
    out = []
    for r in range(R):
        entries = []
        for j in range(len(tokens[r])):
            alternatives = sorted(((t, v) for t, v in zip(best[r][j], best_lp[r][j]) if v > -math.inf),
                                  key=lambda a: -a[1])[: top[r]] if k else []
            entries.append((chosen[r][j], alternatives))
        out.append(entries)
    return out


def top_logits(logits: mx.array, k: int = 4) -> list[list[tuple[int, float]]]:
    """The ``k`` highest ``(token, logit)`` pairs of each row of ``[n, vocab]``
    logits, best first (float32 values)."""
    order = mx.argsort(-logits.astype(mx.float32), axis=-1)[:, :k]
    values = mx.take_along_axis(logits, order, axis=-1).astype(mx.float32)
    return [list(zip(t, v)) for t, v in zip(order.tolist(), values.tolist())]


def scaled_logprobs(logits: mx.array, params: list[SamplingParams]) -> mx.array:
    """``filtered_logprobs / T`` for each row (axis 0) of ``[R, T, V]``
    logits, each row with its own parameters."""
    groups = _rows_by_filter(params)
    if len(groups) == 1:
        filtered = filtered_logprobs(logits, groups[0][0])
    else:
        parts = [None] * len(params)
        for p, rows in groups:
            out = filtered_logprobs(logits[mx.array(rows)], p)
            for i, r in enumerate(rows):
                parts[r] = out[i : i + 1]
        filtered = mx.concatenate(parts, axis=0)
    temperature = mx.array([max(p.temperature, 1e-9) for p in params], dtype=mx.float32)
    return filtered / temperature.reshape(-1, *([1] * (logits.ndim - 1)))


def choose(logits: mx.array, params: list[SamplingParams], positions: mx.array, stream: int = TARGET) -> mx.array:
    """The token of each row at each position, ``[R, T]`` int32, for
    ``[R, T, V]`` logits: greedy rows take the argmax of the
    log-probabilities (as mlx-lm's ``generate_step``), sampling rows the
    Gumbel-max choice at their seed and positions."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    greedy = mx.argmax(logprobs, axis=-1).astype(mx.int32)
    if all(p.greedy for p in params):
        return greedy
    noise = gumbel([p.seed for p in params], positions, logits.shape[-1], stream)
    sampled = mx.argmax(scaled_logprobs(logits, params) + noise, axis=-1).astype(mx.int32)
    if all(not p.greedy for p in params):
        return sampled
    is_greedy = mx.array([p.greedy for p in params])[:, None]
    return mx.where(is_greedy, greedy, sampled)


def positions_of(starts: list[int], width: int) -> mx.array:
    """``[R, width]`` generated positions: row ``r`` from ``starts[r]``."""
    return mx.array(starts, dtype=mx.int32)[:, None] + mx.arange(width, dtype=mx.int32)[None]


def draft_noise(params: list[SamplingParams], starts: list[int], k: int, vocab: int) -> mx.array | None:
    """What makes `draft_choice` an argmax of the head's raw logits, for a
    drafter that computes them itself (`mtp_engine.kernels.cuda_chain`):
    ``[R, k, vocab]`` float32, row ``r``'s draft ``j`` being
    ``argmax(logits + noise[r, j])``. Greedy rows get zeros; exact-sampler
    rows ``T * g`` with the target's Gumbel noise ``g`` at generated positions
    ``starts[r] + j`` (``argmax(logprobs / T + g)`` scaled by ``T``). Their
    filters are left out: a token a filter drops is proposed at most, and the
    verify rejects it. None when every row is greedy. Rejection-sampler rows
    draw from the head's distribution instead: a ValueError."""
    if any(p.rejects for p in params):
        raise ValueError("rejection-sampler rows draft from the head's distribution, not by an argmax")
    if all(p.greedy for p in params):
        return None
    scale = mx.array([p.temperature for p in params], dtype=mx.float32)[:, None, None]  # greedy rows: 0
    return scale * gumbel([p.seed for p in params], positions_of(starts, k), vocab)  # (finite: uniforms are in (0, 1))


def ranked_rows(logits: mx.array, params: list[SamplingParams], positions: list[int], k: int) -> list[list[int]]:
    """The ``k`` best choices of each row of ``[R, V]`` logits at its
    generated position (greedy rows: likeliest first; sampling rows: by the
    targets' perturbed scores), for branching drafts under the exact sampler."""
    k = min(k, logits.shape[-1])
    score = logits
    if not all(p.greedy for p in params):
        noise = gumbel([p.seed for p in params], mx.array(positions, dtype=mx.int32)[:, None], logits.shape[-1])
        sampled = scaled_logprobs(logits[:, None], params)[:, 0] + noise[:, 0]
        greedy = mx.array([p.greedy for p in params])[:, None]
        score = mx.where(greedy, logits.astype(mx.float32), sampled)
    return mx.argsort(-score, axis=-1)[:, :k].tolist()


def draft_choice(logits: mx.array, params: list[SamplingParams], positions: mx.array) -> tuple[mx.array, mx.array | None]:
    """Each row's draft from the head's ``[R, T, V]`` logits at generated
    ``positions`` ``[R, T]``: greedy rows the argmax, exact-sampler rows the
    targets' choice (their noise), rejection-sampler rows a sample of the
    head's filtered distribution (independent noise). Returns the drafts
    ``[R, T]`` and, when any row uses the rejection sampler, every row's
    scaled log-probabilities ``[R, T, V]`` (what acceptance compares)."""
    rejecting = [p.rejects for p in params]
    if not any(rejecting):
        return choose(logits, params, positions), None
    scaled = scaled_logprobs(logits, params)
    seeds = [p.seed for p in params]
    sampled = mx.argmax(scaled + gumbel(seeds, positions, logits.shape[-1], DRAFT), axis=-1).astype(mx.int32)
    if all(rejecting):
        return sampled, scaled
    others = choose(logits, params, positions)
    return mx.where(mx.array(rejecting)[:, None], sampled, others), scaled

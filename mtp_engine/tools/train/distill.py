"""Self-distill a checkpoint's MTP head on its own trunk's predictions.

Speculative decoding accepts a draft token only where it equals the trunk's
greedy choice, so the head's real target is the trunk's argmax, not the
data's next token. This trains the head alone (the trunk, embedding and LM
head stay frozen, so greedy output and losslessness are untouched) to match
the trunk's next-token distribution ``P_{i+j}`` at every draft depth ``j``:

- step 1: ``(H_i, t_{i+1}) -> P_{i+1}`` (the trunk's prediction of ``t_{i+2}``);
- step ``j > 1``: ``(M^{j-1}_i, t_{i+j}) -> P_{i+j}``, the head fed its own
  hidden, as chained drafting does.

The loss mixes the cross-entropy to the trunk's argmax (hard targets, weight
``hard_weight``, default 1) and to its softmax (soft targets): acceptance only
asks for the argmax (hard_weight 1 and 0.5 did about as well on the
shipped model: docs/BENCHMARKS.md). Windows come from the training corpus, and with ``generated_fraction > 0``
partly from the trunk's own greedy continuations of corpus prefixes: that is
the text the head drafts on at decode time (repetitive loops included).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from mtp_engine.tools.train.fit import learning_rate, make_train_step


@dataclass
class DistillSettings:
    """Settings of one distillation run; a bad value raises ValueError naming it.

    ``depth_weights`` sets both the number of chained draft steps trained and
    each one's loss weight; ``hard_weight`` mixes argmax (1) and softmax (0)
    targets; ``generated_fraction`` of the windows are the trunk's greedy
    continuations of ``prefix_len``-token corpus prefixes. With
    ``max_seconds`` the cosine schedule runs on time as well as steps.
    """

    seq_len: int = 256
    batch_size: int = 32
    steps: int = 2000
    lr: float = 5e-4
    min_lr: float = 2e-5
    warmup: int = 50
    weight_decay: float = 0.0
    clip: float = 1.0
    depth_weights: tuple[float, ...] = (1.0, 0.8, 0.6, 0.4)
    hard_weight: float = 1.0
    generated_fraction: float = 0.25
    prefix_len: int = 32
    seed: int = 0
    eval_every: int = 250
    max_seconds: float | None = None
    compile: bool = True

    def __post_init__(self):
        depth = len(self.depth_weights)
        if depth < 1 or self.seq_len <= depth + 1:
            raise ValueError(f"need 1 <= depth (the number of depth_weights) < seq_len - 1, "
                             f"got depth {depth}, seq_len {self.seq_len}")
        if any(w < 0 for w in self.depth_weights) or sum(self.depth_weights) <= 0:
            raise ValueError(f"depth_weights must be >= 0 with a positive sum, got {self.depth_weights}")
        if not 0.0 <= self.hard_weight <= 1.0:
            raise ValueError(f"hard_weight must be in [0, 1], got {self.hard_weight}")
        if not 0.0 <= self.generated_fraction <= 1.0:
            raise ValueError(f"generated_fraction must be in [0, 1], got {self.generated_fraction}")
        if self.generated_fraction and not 0 < self.prefix_len < self.seq_len:
            raise ValueError(f"prefix_len must be in (0, seq_len), got {self.prefix_len}")
        if self.batch_size < 1 or self.steps < 1 or self.lr <= 0:
            raise ValueError(f"batch_size and steps must be >= 1 and lr > 0, got "
                             f"{self.batch_size}, {self.steps}, {self.lr}")


def depth_losses(
    model, head, x: mx.array, depth: int, hard_weight: float = 1.0
) -> tuple[list[mx.array], list[mx.array]]:
    """Cross-entropy of each draft depth against the trunk (soft and hard
    targets mixed by ``hard_weight``), and the fraction of positions where
    the head's argmax equals the trunk's.

    Args:
        model: The trunk (mlx-lm ``qwen3_next.Model``), frozen.
        head: The `MTPHead` being trained.
        x: Token windows ``[B, T]``.
        depth: Number of chained draft steps (``depth < T``).
    """
    inner = model.model
    hidden = mx.stop_gradient(inner(x))  # H_0 .. H_{T-1}, final-normed
    teacher_logits = mx.stop_gradient(model.lm_head(hidden))
    teacher = mx.softmax(teacher_logits.astype(mx.float32), axis=-1)
    teacher_top = mx.argmax(teacher_logits, axis=-1)
    embeds = inner.embed_tokens(x)
    losses, agree = [], []
    prev = hidden
    for j in range(1, depth + 1):
        m = head(prev[:, :-1], embeds[:, j:], None)  # position i predicts what P_{i+j} predicts
        logits = model.lm_head(m).astype(mx.float32)
        logp = nn.log_softmax(logits, axis=-1)
        soft = -(teacher[:, j:] * logp).sum(-1).mean()
        hard = -mx.take_along_axis(logp, teacher_top[:, j:, None], axis=-1).mean()
        losses.append((1 - hard_weight) * soft + hard_weight * hard)
        agree.append((mx.argmax(logits, -1) == teacher_top[:, j:]).astype(mx.float32).mean())
        prev = m
    return losses, agree


def greedy_continuations(model, prefixes: np.ndarray, length: int) -> np.ndarray:
    """The trunk's greedy continuation of each prefix, ``[B, P + length]``
    (batched, all prefixes the same length, so no padding)."""
    cache = model.make_cache()
    tokens = mx.array(prefixes.astype(np.int32))
    logits = model(tokens, cache=cache)[:, -1]
    out = [tokens]
    for _ in range(length):
        nxt = mx.argmax(logits, axis=-1).astype(mx.int32)[:, None]
        out.append(nxt)
        logits = model(nxt, cache=cache)[:, -1]
        mx.async_eval(logits)
    return np.array(mx.concatenate(out, axis=1))


class Windows:
    """Training windows: corpus spans, a fraction of them replaced by the
    trunk's greedy continuation of a corpus prefix (made in batches and
    drawn from a pool, so generation is spread over the run)."""

    def __init__(self, model, tokens: np.ndarray, settings: DistillSettings, rng: np.random.Generator):
        self.model, self.tokens, self.s, self.rng = model, tokens, settings, rng
        self.pool: list[np.ndarray] = []
        self.rows = min(max(2 * settings.batch_size, 16), 256)

    def _corpus(self, n: int, span: int) -> np.ndarray:
        starts = self.rng.integers(0, len(self.tokens) - span, n)
        return np.stack([self.tokens[s : s + span] for s in starts])

    def _refill(self) -> None:
        s = self.s
        # Decoding costs about the same for 256 rows as for 16 on a GPU. MLX's
        # CUDA backend has failed kernel launches at large batches
        # ("cudaGraphAddKernelNode ... invalid argument" at 256 and 512 rows on an
        # H200; 64 ran): halve
        # the batch and try again.
        while True:
            prefixes = self._corpus(self.rows, s.prefix_len)
            try:
                rows = greedy_continuations(self.model, prefixes, s.seq_len - s.prefix_len)
                break
            except RuntimeError as e:
                if self.rows <= 8:
                    raise
                self.rows //= 2
                print(f"greedy generation failed ({e}); retrying with {self.rows} rows", flush=True)
        self.pool.extend(rows)

    def next(self) -> mx.array:
        s = self.s
        n_gen = int(self.rng.binomial(s.batch_size, s.generated_fraction)) if s.generated_fraction else 0
        rows = list(self._corpus(s.batch_size - n_gen, s.seq_len))
        while len(self.pool) < n_gen:
            self._refill()
        rows += [self.pool.pop() for _ in range(n_gen)]
        return mx.array(np.stack(rows).astype(np.int32))


def evaluate(
    model, head, tokens: np.ndarray, seq_len: int, depth: int, hard_weight: float = 1.0, max_windows: int = 128
) -> dict:
    """Agreement of each draft depth's argmax with the trunk's on held-out
    windows (the acceptance rate of that depth given earlier ones accepted,
    under teacher forcing)."""
    n = min(max_windows, len(tokens) // seq_len)
    windows = np.stack([tokens[i * seq_len : (i + 1) * seq_len] for i in range(n)]).astype(np.int32)
    sums = np.zeros(depth)
    loss = np.zeros(depth)
    for i in range(0, n, 16):
        losses, agree = depth_losses(model, head, mx.array(windows[i : i + 16]), depth, hard_weight)
        b = min(16, n - i)
        sums += np.array([a.item() for a in agree]) * b
        loss += np.array([v.item() for v in losses]) * b
    return {
        **{f"agree{j + 1}": round(float(sums[j] / n), 4) for j in range(depth)},
        **{f"loss{j + 1}": round(float(loss[j] / n), 4) for j in range(depth)},
    }


def distill(
    model, head, train_tokens: np.ndarray, held_tokens: np.ndarray, s: DistillSettings, log=print, on_eval=None
) -> list[dict]:
    """Train ``head`` in place; returns the evaluation history (step 0 first).

    ``on_eval(history)``, if given, runs after every evaluation but the
    first (the command saves the head there, so a killed run keeps its last
    evaluated head)."""
    depth = len(s.depth_weights)
    for name, tokens in (("train_tokens", train_tokens), ("held_tokens", held_tokens)):
        if len(tokens) <= s.seq_len:
            raise ValueError(f"{name} has {len(tokens)} tokens; need more than seq_len {s.seq_len}")
    model.freeze()
    model.eval()
    head.train()
    weights = mx.array(s.depth_weights)
    optimizer = optim.AdamW(learning_rate=s.lr, weight_decay=s.weight_decay)

    def loss_fn(head, x):
        losses, agree = depth_losses(model, head, x, depth, s.hard_weight)
        return (mx.stack(losses) * weights).sum() / weights.sum(), mx.stack(agree)

    step_fn, state = make_train_step(head, loss_fn, optimizer, s.clip, s.compile)

    history = [{"step": 0, **evaluate(model, head, held_tokens, s.seq_len, depth, s.hard_weight)}]
    log(f"eval step 0: {json.dumps(history[-1])}")
    rng = np.random.default_rng(s.seed)
    windows = Windows(model, train_tokens, s, rng)
    started = time.perf_counter()
    seen = 0
    step = 0
    while step < s.steps:
        optimizer.learning_rate = learning_rate(s, step, time.perf_counter() - started)
        x = windows.next()
        loss, agree = step_fn(x)
        mx.eval(loss, state)
        step += 1
        seen += x.size
        if step % 25 == 0 or step == 1:
            rate = seen / (time.perf_counter() - started)
            log(f"step {step} loss {loss.item():.3f} agree {np.round(np.array(agree), 3).tolist()} | {rate:.0f} tok/s")
        out_of_time = s.max_seconds and time.perf_counter() - started > s.max_seconds
        if step % s.eval_every == 0 or step == s.steps or out_of_time:
            history.append({"step": step, "tokens": seen, **evaluate(model, head, held_tokens, s.seq_len, depth, s.hard_weight)})
            log(f"eval step {step}: {json.dumps(history[-1])}")
            if on_eval is not None:
                on_eval(history)
        if out_of_time:
            log(f"time budget reached at step {step}")
            break
    return history

"""Train a small Qwen3-Next and its MTP head from scratch, jointly.

Loss = LM loss of the trunk + MTP losses. The MTP head gets the trunk's
final-normed hidden with gradients stopped (the trunk learns only from its
own loss, apart from the shared embedding and LM head). Step 1 trains
``(H_i, t_{i+1}) -> t_{i+2}``; step 2 feeds the head its own hidden,
``(M_i, t_{i+2}) -> t_{i+3}``, as chained drafting does.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.qwen3_next import Model

from mtp_engine.io.tiny import tiny_config
from mtp_engine.model.mtp_head import MTPHead, build_models


def shipped_config(**overrides) -> dict:
    """Config of the shipped model: 8 layers (6 gated-delta, 2 gated
    attention), hidden 256, 4 experts top-2 with a shared expert, one MTP
    layer, a 3072-token BPE vocabulary. About 8.5M parameters."""
    config = tiny_config(
        hidden_size=256,
        num_hidden_layers=8,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        vocab_size=3072,
        max_position_embeddings=8192,
        torch_dtype="bfloat16",
    )
    config.update(overrides)
    return config


@dataclass
class TrainSettings:
    seq_len: int = 256
    batch_size: int = 64
    steps: int = 4000
    lr: float = 1.5e-3
    min_lr: float = 1e-4
    warmup: int = 200
    weight_decay: float = 0.05
    clip: float = 1.0
    mtp_weights: tuple[float, float] = (1.0, 0.5)
    seed: int = 0
    eval_every: int = 500
    max_seconds: float | None = None
    compile: bool = True


class Trainee(nn.Module):
    """Trunk and head in one module, for one optimizer."""

    def __init__(self, model: Model, head: MTPHead):
        super().__init__()
        self.model = model
        self.head = head

    def lm_head(self, h: mx.array) -> mx.array:
        return self.model.lm_head(h)


def losses(trainee: Trainee, x: mx.array):
    """LM loss and the two MTP losses for token windows ``x`` ``[B, T+1]``."""
    model, head = trainee.model, trainee.head
    embed = model.model.embed_tokens
    h = model.model(x[:, :-1])  # [B, T, dim], final-normed
    lm = nn.losses.cross_entropy(trainee.lm_head(h), x[:, 1:], reduction="mean")
    hs = mx.stop_gradient(h)
    m1 = head(hs[:, :-1], embed(x[:, 1:-1]), None)  # predicts x[:, 2:]
    mtp1 = nn.losses.cross_entropy(trainee.lm_head(m1), x[:, 2:], reduction="mean")
    m2 = head(m1[:, :-1], embed(x[:, 2:-1]), None)  # predicts x[:, 3:]
    mtp2 = nn.losses.cross_entropy(trainee.lm_head(m2), x[:, 3:], reduction="mean")
    return lm, mtp1, mtp2


def batches(tokens: np.ndarray, settings: TrainSettings, rng: np.random.Generator):
    span = settings.seq_len + 1
    while True:
        starts = rng.integers(0, len(tokens) - span, settings.batch_size)
        yield mx.array(np.stack([tokens[s : s + span] for s in starts]).astype(np.int32))


def evaluate(trainee: Trainee, tokens: np.ndarray, seq_len: int, max_windows: int = 256) -> dict:
    """Held-out perplexity of the trunk and top-1 accuracy of the MTP head's
    next-next-token prediction (step 1) and of its chained step 2."""
    trainee.eval()
    span = seq_len + 1
    n = min(max_windows, (len(tokens) - 1) // span)
    windows = np.stack([tokens[i * span : (i + 1) * span] for i in range(n)]).astype(np.int32)
    total = {"lm": 0.0, "mtp1_acc": 0.0, "mtp2_acc": 0.0, "next_acc": 0.0}
    count = 0
    for i in range(0, n, 16):
        x = mx.array(windows[i : i + 16])
        model, head = trainee.model, trainee.head
        embed = model.model.embed_tokens
        h = model.model(x[:, :-1])
        logits = trainee.lm_head(h)
        m1 = head(h[:, :-1], embed(x[:, 1:-1]), None)
        m2 = head(m1[:, :-1], embed(x[:, 2:-1]), None)
        b = x.shape[0]
        total["lm"] += nn.losses.cross_entropy(logits, x[:, 1:], reduction="mean").item() * b
        total["next_acc"] += (mx.argmax(logits, -1) == x[:, 1:]).astype(mx.float32).mean().item() * b
        total["mtp1_acc"] += (mx.argmax(trainee.lm_head(m1), -1) == x[:, 2:]).astype(mx.float32).mean().item() * b
        total["mtp2_acc"] += (mx.argmax(trainee.lm_head(m2), -1) == x[:, 3:]).astype(mx.float32).mean().item() * b
        count += b
    trainee.train()
    out = {k: v / count for k, v in total.items()}
    out["perplexity"] = math.exp(out.pop("lm"))
    return out


def build(config: dict, seed: int) -> Trainee:
    mx.random.seed(seed)
    model, head = build_models(config)
    trainee = Trainee(model, head)
    # Small init for the embedding (nn.Embedding's default is N(0, 1/dim)).
    model.model.embed_tokens.weight = mx.random.normal(model.model.embed_tokens.weight.shape) * 0.02
    mx.eval(trainee.parameters())
    return trainee


def save_state(folder: Path, trainee: Trainee, optimizer, step: int, log: list) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "weights.safetensors"), dict(tree_flatten(trainee.parameters())))
    mx.save_safetensors(str(folder / "optimizer.safetensors"), dict(tree_flatten(optimizer.state)))
    (folder / "progress.json").write_text(json.dumps({"step": step, "log": log}, indent=1))


def load_state(folder: Path, trainee: Trainee, optimizer) -> tuple[int, list]:
    trainee.load_weights(str(folder / "weights.safetensors"))

    optimizer.state = tree_unflatten(list(mx.load(str(folder / "optimizer.safetensors")).items()))
    progress = json.loads((folder / "progress.json").read_text())
    return progress["step"], progress["log"]


def train(
    config: dict,
    train_tokens: np.ndarray,
    held_tokens: np.ndarray,
    settings: TrainSettings,
    state_dir: Path,
    log=print,
) -> tuple[Trainee, list]:
    """Train (resuming from ``state_dir`` if it holds a state); returns the
    trainee and the log of evaluations."""
    trainee = build(config, settings.seed)
    optimizer = optim.AdamW(learning_rate=settings.lr, weight_decay=settings.weight_decay)
    step, history = 0, []
    if (state_dir / "progress.json").exists():
        step, history = load_state(state_dir, trainee, optimizer)
        log(f"resumed at step {step}")
    w1, w2 = settings.mtp_weights

    def loss_fn(t, x):
        lm, mtp1, mtp2 = losses(t, x)
        return lm + w1 * mtp1 + w2 * mtp2, (lm, mtp1, mtp2)

    train_step, state = make_train_step(trainee, loss_fn, optimizer, settings.clip, settings.compile)

    rng = np.random.default_rng(settings.seed + step)
    data = batches(train_tokens, settings, rng)
    trainee.train()
    started = time.perf_counter()
    tokens_seen = 0
    while step < settings.steps:
        optimizer.learning_rate = learning_rate(settings, step, time.perf_counter() - started)
        x = next(data)
        loss, (lm, mtp1, mtp2) = train_step(x)
        mx.eval(loss, state)
        step += 1
        tokens_seen += x.size
        if step % 50 == 0 or step == 1:
            elapsed = time.perf_counter() - started
            log(
                f"step {step} loss {loss.item():.3f} lm {lm.item():.3f} mtp1 {mtp1.item():.3f} "
                f"mtp2 {mtp2.item():.3f} | {tokens_seen / elapsed:.0f} tok/s"
            )
        if step % settings.eval_every == 0 or step == settings.steps:
            metrics = evaluate(trainee, held_tokens, settings.seq_len)
            history.append({"step": step, **metrics})
            log(f"eval step {step}: {json.dumps(metrics)}")
            save_state(state_dir, trainee, optimizer, step, history)
        if settings.max_seconds and time.perf_counter() - started > settings.max_seconds:
            log(f"time budget reached at step {step}")
            break
    if not history or history[-1]["step"] != step:
        metrics = evaluate(trainee, held_tokens, settings.seq_len)
        history.append({"step": step, **metrics})
        log(f"eval step {step}: {json.dumps(metrics)}")
    save_state(state_dir, trainee, optimizer, step, history)
    return trainee, history


def make_train_step(module: nn.Module, loss_fn, optimizer, clip: float, compile: bool):
    """One optimizer step on ``module``'s trainable parameters.

    ``loss_fn(module, x)`` returns ``(loss, aux)``. Returns ``(step, state)``:
    ``step(x)`` computes gradients, clips their global norm to ``clip``,
    updates and returns ``(loss, aux)`` (lazily; evaluate ``state`` with it),
    compiled with ``mx.compile`` when ``compile``.
    """
    grad_fn = nn.value_and_grad(module, loss_fn)
    state = [module.state, optimizer.state]

    def step(x):
        (loss, aux), grads = grad_fn(module, x)
        grads, _ = optim.clip_grad_norm(grads, clip)
        optimizer.update(module, grads)
        return loss, aux

    if compile:
        step = mx.compile(step, inputs=state, outputs=state)
    return step, state


def learning_rate(settings, step: int, elapsed: float) -> float:
    """Linear warmup, then cosine decay to ``min_lr``. Progress is the larger
    of steps done and time spent (with ``max_seconds``), so a run cut short by
    its time budget still ends its schedule. ``settings`` is a `TrainSettings`
    or anything with its ``lr``, ``min_lr``, ``warmup``, ``steps`` and
    ``max_seconds`` (`DistillSettings`)."""
    if step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    progress = step / settings.steps
    if settings.max_seconds:
        progress = max(progress, elapsed / settings.max_seconds)
    progress = min(progress, 1.0)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return settings.min_lr + (settings.lr - settings.min_lr) * cosine


def settings_dict(settings: TrainSettings) -> dict:
    return asdict(settings)

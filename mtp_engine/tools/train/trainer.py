"""Training in PyTorch: ``fit`` (trunk and MTP head jointly, from scratch)
and ``distill`` (the head alone, on the trunk's own continuations).

Both are resumable runs: they write a checkpoint (`checkpoint`) every
``checkpoint_minutes`` and at the end, log one line per ``log_every`` steps
to their log file, and continue from a checkpoint folder's latest step (or a
portable copy) where they stopped. The data order is a function of
``(seed, step)``, so a resumed run draws the batches the uninterrupted run
would have drawn. The learning-rate schedule runs on steps and, with
``max_seconds``, on training time (summed over resumes), so a run cut short
by its budget still finishes its schedule.

fit's loss: the trunk's next-token cross-entropy, plus the head's losses on
the trunk's final-normed hidden with gradients stopped (step 1
``(H_i, t_{i+1}) -> t_{i+2}``, chained step 2 ``(M_i, t_{i+2}) -> t_{i+3}``),
which reach neither the trunk nor the shared embedding and LM head, plus a
small load-balancing term for the routers. With ``unlikelihood`` > 0 (a
tune of a fitted model) it adds sequence-level unlikelihood (Welleck et al.,
2020, "Neural text generation with unlikelihood training"): the trunk
continues corpus prefixes greedily (a pool regenerated every
``regenerate_every`` steps), and every token of those continuations that
repeats a cycle (`loop_mask`) gets the loss ``-log(1 - p(token))``, so
the trunk learns to leave the loops that greedy decoding falls into; the
next-token loss on corpus windows keeps the rest of its distribution.

distill's loss, at every draft depth ``j`` (``(M^{j-1}_i, t_{i+j})``, the
head fed its own hidden as chained drafting does): cross-entropy to the
trunk's distribution at position ``i+j`` mixed with cross-entropy to its
argmax (``hard_weight``). Its sequences are corpus prefixes continued by the
trunk itself, greedily and sampled at each of ``temperatures``, regenerated
every ``regenerate_every`` steps, plus plain corpus windows: the text the
head drafts on when a job runs.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from mtp_engine.tools.loops import find_loop
from mtp_engine.tools.train.checkpoint import read_checkpoint, write_step
from mtp_engine.tools.train.torch_model import Trainee


@dataclass
class FitSettings:
    seq_len: int = 512
    batch_size: int = 64
    steps: int = 20000
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup: int = 300
    weight_decay: float = 0.1
    clip: float = 1.0
    mtp_weights: tuple[float, float] = (1.0, 0.5)
    moe_aux_weight: float = 0.01
    unlikelihood: float = 0.0
    ul_batch: int = 64
    prefix_len: int = 64
    new_tokens: int = 128
    pool_sequences: int = 2048
    regenerate_every: int = 100
    seed: int = 0
    eval_every: int = 500
    log_every: int = 50
    checkpoint_minutes: float = 3.0
    max_seconds: float | None = None
    compile: bool = True

    def __post_init__(self):
        if self.seq_len < 4 or self.batch_size < 1 or self.steps < 1 or self.lr <= 0:
            raise ValueError(f"need seq_len >= 4, batch_size, steps >= 1 and lr > 0, got {self.seq_len}, "
                             f"{self.batch_size}, {self.steps}, {self.lr}")
        if self.unlikelihood < 0 or (self.unlikelihood and min(self.ul_batch, self.prefix_len, self.new_tokens,
                                                               self.pool_sequences, self.regenerate_every) < 1):
            raise ValueError(f"unlikelihood must be >= 0, and with it ul_batch, prefix_len, new_tokens, "
                             f"pool_sequences and regenerate_every >= 1; got {self.unlikelihood}, {self.ul_batch}, "
                             f"{self.prefix_len}, {self.new_tokens}, {self.pool_sequences}, {self.regenerate_every}")


@dataclass
class DistillSettings:
    seq_len: int = 256
    batch_size: int = 128
    steps: int = 4000
    lr: float = 1e-3
    min_lr: float = 5e-5
    warmup: int = 100
    weight_decay: float = 0.0
    clip: float = 1.0
    depth_weights: tuple[float, ...] = (1.0, 0.8, 0.6, 0.4)
    hard_weight: float = 0.5
    temperatures: tuple[float, ...] = (0.0, 0.7, 1.0)
    corpus_fraction: float = 0.25
    prefix_len: int = 64
    pool_sequences: int = 2048
    regenerate_every: int = 500
    seed: int = 0
    eval_every: int = 250
    log_every: int = 50
    checkpoint_minutes: float = 3.0
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
        if not 0.0 <= self.corpus_fraction < 1.0 or any(t < 0 for t in self.temperatures) or not self.temperatures:
            raise ValueError(f"corpus_fraction must be in [0, 1) and temperatures >= 0 (at least one), got "
                             f"{self.corpus_fraction}, {self.temperatures}")
        if not 0 < self.prefix_len < self.seq_len:
            raise ValueError(f"prefix_len must be in (0, seq_len), got {self.prefix_len}")


def learning_rate(s, step: int, elapsed: float) -> float:
    """Linear warm-up, then cosine decay to ``min_lr``; progress is the larger
    of steps done and training time spent (with ``max_seconds``)."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    progress = step / s.steps
    if s.max_seconds:
        progress = max(progress, elapsed / s.max_seconds)
    return s.min_lr + (s.lr - s.min_lr) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def autocast(dev: torch.device):
    """bfloat16 matrix products on a GPU, float32 elsewhere."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)


class Log:
    """Lines to a log file (flushed) and to stdout."""

    def __init__(self, path: Path | None):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a", buffering=1) if path else None

    def __call__(self, message: str) -> None:
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}"
        print(line, flush=True)
        if self.file:
            self.file.write(line + "\n")


def windows(tokens: torch.Tensor, starts: torch.Tensor, span: int) -> torch.Tensor:
    return tokens[starts[:, None] + torch.arange(span, device=tokens.device)].long()


def batch_starts(n_tokens: int, span: int, batch: int, seed: int, step: int) -> torch.Tensor:
    """Window starts of a step: a pure function of (seed, step)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, n_tokens - span, (batch,), generator=g)


def lm_logits(trainee: Trainee, h: torch.Tensor, frozen: bool) -> torch.Tensor:
    w = trainee.trunk.lm_head.weight
    return F.linear(h, w.detach() if frozen else w)


def fit_losses(trainee: Trainee, x: torch.Tensor):
    """(lm, mtp1, mtp2, moe aux) for windows ``x`` ``[B, T+1]``."""
    trunk, head = trainee.trunk, trainee.head
    h = trunk.hidden(x[:, :-1])
    lm = F.cross_entropy(trunk.lm_head(h).float().flatten(0, 1), x[:, 1:].flatten())
    emb = trunk.model.embed_tokens(x).detach()
    hs = h.detach()
    m1 = head(hs[:, :-1], emb[:, 1:-1])
    mtp1 = F.cross_entropy(lm_logits(trainee, m1, True).float().flatten(0, 1), x[:, 2:].flatten())
    m2 = head(m1[:, :-1], emb[:, 2:-1])
    mtp2 = F.cross_entropy(lm_logits(trainee, m2, True).float().flatten(0, 1), x[:, 3:].flatten())
    return lm, mtp1, mtp2, trainee.moe_aux()


# A token is in a loop when it equals the token `period` (<= LOOP_PERIOD)
# before it inside a stretch of at least LOOP_RUN such tokens, and is past
# that stretch's first repetition of its cycle (a line written twice can be
# right; the third time round is a loop). `mtp_engine.tools.loops` counts an
# output as looping when its last 48 tokens repeat a cycle of period <= 12.
LOOP_PERIOD = 12
LOOP_RUN = 24


def loop_mask(x: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Boolean ``[B, T]``: tokens of ``x`` ``[B, T]`` (from column ``start``)
    that repeat a cycle, as defined above."""
    B, T = x.shape
    mask = torch.zeros(B, T, dtype=torch.bool, device=x.device)
    for period in range(1, LOOP_PERIOD + 1):
        if T <= period:
            break
        eq = (x[:, period:] == x[:, :-period]).int()  # eq[:, i]: x[i + period] repeats x[i]
        n = eq.shape[1]
        forward = torch.zeros_like(eq)  # length of the stretch of equal pairs ending at i
        backward = torch.zeros_like(eq)  # ... starting at i
        run_f = torch.zeros(B, dtype=eq.dtype, device=x.device)
        run_b = torch.zeros_like(run_f)
        for i in range(n):
            run_f = (run_f + 1) * eq[:, i]
            forward[:, i] = run_f
            run_b = (run_b + 1) * eq[:, n - 1 - i]
            backward[:, n - 1 - i] = run_b
        looping = (forward + backward - 1 >= LOOP_RUN) & (forward > period) & (eq > 0)
        mask[:, period:] |= looping
    mask[:, :start] = False
    return mask


def unlikelihood_loss(trunk, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``-log(1 - p(x_t | x_<t))`` over the tokens ``mask`` marks
    (``mask[:, 0]`` is ignored: nothing predicts the first token)."""
    logits = trunk.lm_head(trunk.hidden(x[:, :-1])).float()
    target_logp = logits.log_softmax(-1).gather(-1, x[:, 1:, None])[..., 0]
    penalty = -torch.log1p(-target_logp.exp().clamp(max=1 - 1e-5))
    m = mask[:, 1:].float()
    return (penalty * m).sum() / m.sum().clamp(min=1.0)


@torch.no_grad()
def evaluate(trainee: Trainee, held: torch.Tensor, seq_len: int, dev, depth: int = 4, max_windows: int = 128) -> dict:
    """Held-out perplexity and next-token accuracy of the trunk; agreement of
    the head's chained drafts (teacher-forced) with the data's next tokens
    and with the trunk's argmax, and the overlap ``sum min(p, q)`` of the
    head's and the trunk's distributions, at depths 1..``depth``."""
    trainee.eval()
    span = seq_len + 1
    n = min(max_windows, (len(held) - 1) // span)
    x_all = held[: n * span].view(n, span).long()
    sums: dict[str, float] = {}
    count = 0
    for i in range(0, n, 16):
        x = x_all[i : i + 16].to(dev)
        with autocast(dev):
            h = trainee.trunk.hidden(x[:, :-1])
            logits = trainee.trunk.lm_head(h).float()
            emb = trainee.trunk.model.embed_tokens(x)
            add = {"lm": F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).item(),
                   "next_acc": (logits.argmax(-1) == x[:, 1:]).float().mean().item()}
            m, T = h, x.shape[1] - 1
            for j in range(1, depth + 1):
                m = trainee.head(m[:, : T - j], emb[:, j:T])
                q = lm_logits(trainee, m, True).float()
                p = logits[:, j:T]
                add[f"head{j}_data_acc"] = (q.argmax(-1) == x[:, j + 1 :]).float().mean().item()
                add[f"head{j}_trunk_acc"] = (q.argmax(-1) == p.argmax(-1)).float().mean().item()
                add[f"head{j}_overlap"] = torch.minimum(p.softmax(-1), q.softmax(-1)).sum(-1).mean().item()
        for k, v in add.items():
            sums[k] = sums.get(k, 0.0) + v * x.shape[0]
        count += x.shape[0]
    trainee.train()
    out = {k: round(v / count, 4) for k, v in sums.items()}
    out["perplexity"] = round(math.exp(out.pop("lm")), 3)
    return out


def _param_groups(module: torch.nn.Module, weight_decay: float):
    decay = [p for p in module.parameters() if p.requires_grad and p.ndim >= 2]
    rest = [p for p in module.parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def _optimizer_arrays(opt: torch.optim.Optimizer, names: dict) -> dict[str, np.ndarray]:
    out = {}
    for p, state in opt.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                out[f"{names[p]}.{key}"] = state[key].detach().float().cpu().numpy()
        if "step" in state:
            out[f"{names[p]}.step"] = np.asarray([float(state["step"])], dtype=np.float32)
    return out


def _load_optimizer(opt: torch.optim.Optimizer, module: torch.nn.Module, arrays: dict, dev) -> bool:
    """Restore AdamW's moments by parameter name; False if any is missing."""
    params = dict(module.named_parameters())
    if not arrays or any(f"{n}.exp_avg" not in arrays for n, p in params.items() if p.requires_grad):
        return False
    for name, p in params.items():
        if not p.requires_grad:
            continue
        opt.state[p] = {
            "step": torch.tensor(float(arrays[f"{name}.step"][0])),
            "exp_avg": torch.from_numpy(arrays[f"{name}.exp_avg"]).to(dev),
            "exp_avg_sq": torch.from_numpy(arrays[f"{name}.exp_avg_sq"]).to(dev),
        }
    return True


class Run:
    """What fit and distill share: the trainee on its device, the optimizer
    over the trainable parameters, resume, periodic checkpoints."""

    def __init__(self, kind: str, config: dict, settings, out: Path, log: Log, trainable: str | None = None):
        self.kind, self.config, self.settings, self.out, self.log = kind, config, settings, Path(out), log
        self.dev = device()
        torch.manual_seed(settings.seed)
        self.trainee = Trainee(config).to(self.dev)
        if trainable:
            for name, p in self.trainee.named_parameters():
                p.requires_grad = name.startswith(trainable + ".")
        self.module = self.trainee.head if trainable == "head" else self.trainee
        self.opt = torch.optim.AdamW(_param_groups(self.module, settings.weight_decay), lr=settings.lr,
                                     betas=(0.9, 0.95), fused=self.dev.type == "cuda")
        self.names = {p: n for n, p in self.module.named_parameters()}
        self.step, self.seconds, self.tokens, self.history = 0, 0.0, 0, []
        self.runs: list[dict] = []

    def load_weights(self, weights: dict[str, np.ndarray]) -> None:
        params = dict(self.trainee.named_parameters())
        missing = sorted(set(params) - set(weights))
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors of this model, e.g. {missing[:3]}")
        with torch.no_grad():
            for name, p in params.items():
                if tuple(weights[name].shape) != tuple(p.shape):
                    raise ValueError(f"{name}: checkpoint shape {weights[name].shape}, model {tuple(p.shape)}")
                p.copy_(torch.from_numpy(np.ascontiguousarray(weights[name])))

    def resume(self, folder: Path) -> None:
        """Continue a run of the same kind (its step, time, history and
        optimizer), or start this kind from another run's weights."""
        config, weights, progress = read_checkpoint(folder)
        if config != self.config:
            raise ValueError(f"{folder} holds a model of another config than this run's")
        self.load_weights(weights)
        self.runs = progress.get("runs", [])
        if progress.get("kind") == self.kind:
            self.step, self.seconds = progress["step"], progress.get("seconds", 0.0)
            self.tokens, self.history = progress.get("tokens", 0), progress.get("history", [])
            if _load_optimizer(self.opt, self.module, progress.get("optimizer_state", {}), self.dev):
                self.log(f"resumed {self.kind} at step {self.step} from {folder} (optimizer state restored)")
            else:
                self.restart_warmup = self.step
                self.log(f"resumed {self.kind} at step {self.step} from {folder} (weights only: "
                         f"the optimizer's moments restart, learning rate warmed up again)")
        else:
            self.log(f"{self.kind} starts from the {progress.get('kind', '?')} weights of {folder}")

    restart_warmup: int | None = None

    def lr(self) -> float:
        s = self.settings
        value = learning_rate(s, self.step, self.seconds)
        if self.restart_warmup is not None and self.step - self.restart_warmup < s.warmup:
            value *= (self.step - self.restart_warmup + 1) / s.warmup
        return value

    def save(self, status: str) -> Path:
        weights = {n: p.detach().float().cpu().numpy() for n, p in self.trainee.named_parameters()}
        progress = {
            "kind": self.kind, "status": status, "seconds": round(self.seconds, 1), "tokens": self.tokens,
            "device": torch.cuda.get_device_name() if self.dev.type == "cuda" else "cpu",
            "torch": torch.__version__, "settings": asdict(self.settings), "history": self.history,
            "runs": self.runs, "written": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        path = write_step(self.out, self.config, self.step, weights, _optimizer_arrays(self.opt, self.names), progress)
        self.log(f"checkpoint {path} ({status})")
        return path

    def step_fn(self, loss_fn):
        """One optimizer step: gradients of ``loss_fn(batch) -> (loss, parts)``
        clipped to ``clip``, AdamW at the scheduled rate."""
        compiled = torch.compile(loss_fn) if self.settings.compile and self.dev.type == "cuda" else loss_fn
        params = [p for p in self.module.parameters() if p.requires_grad]

        def run(batch):
            for group in self.opt.param_groups:
                group["lr"] = self.lr()
            with autocast(self.dev):
                loss, parts = compiled(batch)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, self.settings.clip)
            self.opt.step()
            return loss, parts
        return run

    def loop(self, next_batch, loss_fn, evaluate_fn, budget_label: str = "") -> None:
        s = self.settings
        run = self.step_fn(loss_fn)
        last_save = time.monotonic()
        window_start, window_tokens = time.monotonic(), 0
        first_step = self.step
        while self.step < s.steps and not (s.max_seconds and self.seconds >= s.max_seconds):
            started = time.monotonic()
            batch = next_batch(self.step)
            loss, parts = run(batch)
            self.step += 1
            size = (batch[0] if isinstance(batch, tuple) else batch).numel()
            self.tokens += size
            window_tokens += size
            if self.step % s.log_every == 0 or self.step == 1:
                if self.dev.type == "cuda":
                    torch.cuda.synchronize()
                rate = window_tokens / max(time.monotonic() - window_start, 1e-9)
                self.log(f"{self.kind} step {self.step} loss {loss.item():.4f} "
                         + " ".join(f"{k} {v.item():.4f}" for k, v in parts.items())
                         + f" lr {self.lr():.2e} | {rate:.0f} tok/s, {self.seconds:.0f} s")
                window_start, window_tokens = time.monotonic(), 0
            if self.step > first_step + 1:  # a process's first step compiles: not training time
                self.seconds += time.monotonic() - started
            else:
                self.log(f"{self.kind}: first step (compilation, warm-up) took {time.monotonic() - started:.1f} s, "
                         f"not counted against max_seconds")
            if self.step % s.eval_every == 0:
                self.history.append({"step": self.step, "tokens": self.tokens, "seconds": round(self.seconds, 1),
                                     **evaluate_fn()})
                self.log(f"eval {json.dumps(self.history[-1])}")
            if time.monotonic() - last_save > 60 * s.checkpoint_minutes:
                self.save("running")
                last_save = time.monotonic()
        if not self.history or self.history[-1]["step"] != self.step:
            self.history.append({"step": self.step, "tokens": self.tokens, "seconds": round(self.seconds, 1),
                                 **evaluate_fn()})
            self.log(f"eval {json.dumps(self.history[-1])}")
        self.runs = self.runs + [{"kind": self.kind, "steps": self.step, "tokens": self.tokens,
                                  "seconds": round(self.seconds, 1), "settings": asdict(s), "final": self.history[-1]}]
        self.save("done")


def load_tokens(data: Path, name: str) -> np.ndarray:
    """``name``.npy from the data folder (or its ``.npy.xz`` copy)."""
    path = data / f"{name}.npy"
    if not path.exists() and (data / f"{name}.npy.xz").exists():
        import io
        import lzma

        return np.load(io.BytesIO(lzma.decompress((data / f"{name}.npy.xz").read_bytes())))
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: run `python -m mtp_engine.train prepare --data {data}`")
    return np.load(path)


def fit(config: dict, data: Path, out: Path, settings: FitSettings, resume: Path | None, log: Log) -> Path:
    run = Run("fit", config, settings, out, log)
    if resume:
        run.resume(resume)
    dev = run.dev
    train = torch.from_numpy(load_tokens(data, "train").astype(np.int32)).to(dev)
    held = torch.from_numpy(load_tokens(data, "heldout").astype(np.int32))
    n_params = sum(p.numel() for p in run.trainee.parameters())
    log(f"fit: {n_params / 1e6:.2f}M parameters, {len(train)} training tokens, device {dev}, settings {asdict(settings)}")
    s = settings
    span = s.seq_len + 1
    w1, w2 = s.mtp_weights
    pool: dict = {}

    def regenerate(step: int) -> None:
        """Greedy continuations of corpus prefixes by the trunk as it is now,
        and which of their tokens loop."""
        started = time.monotonic()
        trunk = run.trainee.trunk.eval()
        starts = batch_starts(len(train), s.prefix_len, s.pool_sequences, s.seed + 31, step).to(dev)
        sequences = torch.cat([continue_text(trunk, chunk, s.new_tokens, 0.0, None)
                               for chunk in torch.split(windows(train, starts, s.prefix_len), 1024)])
        run.trainee.train()
        mask = loop_mask(sequences, s.prefix_len)
        rows = [r.tolist() for r in sequences[:, s.prefix_len:].cpu()]
        looping = mask.any(1).nonzero()[:, 0]  # only rows with a penalized token carry a gradient
        pool.update(sequences=sequences, mask=mask, rows=looping if len(looping) else torch.arange(len(mask), device=dev),
                    loop_rate=sum(find_loop(r) is not None for r in rows) / len(rows))
        log(f"fit: {len(rows)} greedy continuations, {pool['loop_rate']:.1%} end in a loop, "
            f"{mask.float().mean().item():.1%} of tokens penalized, {time.monotonic() - started:.1f} s")

    def loss_fn(batch):
        x = batch[0]
        lm, mtp1, mtp2, aux = fit_losses(run.trainee, x)
        total = lm + w1 * mtp1 + w2 * mtp2 + s.moe_aux_weight * aux
        parts = {"lm": lm, "mtp1": mtp1, "mtp2": mtp2}
        if s.unlikelihood:
            parts["ul"] = unlikelihood_loss(run.trainee.trunk, batch[1], batch[2])
            total = total + s.unlikelihood * parts["ul"]
        return total, parts

    def next_batch(step):
        x = windows(train, batch_starts(len(train), span, s.batch_size, s.seed, step).to(dev), span)
        if not s.unlikelihood:
            return (x,)
        if step % s.regenerate_every == 0 or "sequences" not in pool:
            regenerate(step - step % s.regenerate_every)
        g = torch.Generator().manual_seed(s.seed * 1_000_003 + step)
        rows = pool["rows"][torch.randint(0, len(pool["rows"]), (s.ul_batch,), generator=g).to(dev)]
        return x, pool["sequences"][rows], pool["mask"][rows]

    def evaluate_fn():
        result = evaluate(run.trainee, held, s.seq_len, dev)
        return {**result, "pool_loop_rate": round(pool["loop_rate"], 4)} if "loop_rate" in pool else result

    run.loop(next_batch, loss_fn, evaluate_fn)
    return out


@torch.no_grad()
def continue_text(trunk, prompts: torch.Tensor, new_tokens: int, temperature: float, generator: torch.Generator) -> torch.Tensor:
    """``prompts`` ``[B, P]`` continued by the trunk for ``new_tokens``
    (greedy at temperature 0, else sampled from ``softmax(logits / T)``)."""
    dev = prompts.device
    cache = trunk.make_cache(prompts.shape[1] + new_tokens)
    with autocast(dev):
        logits = trunk(prompts, cache)[:, -1].float()
        out = [prompts]
        for _ in range(new_tokens):
            if temperature == 0:
                token = logits.argmax(-1)
            else:
                token = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)[:, 0]
            out.append(token[:, None])
            logits = trunk(token[:, None], cache)[:, -1].float()
    return torch.cat(out, dim=1)


def distill_losses(trainee: Trainee, x: torch.Tensor, s: DistillSettings):
    """The head's loss at each depth against the trunk's distribution."""
    trunk, head = trainee.trunk, trainee.head
    with torch.no_grad():
        h = trunk.hidden(x)
        teacher = trunk.lm_head(h).float()
        emb = trunk.model.embed_tokens(x)
    T = x.shape[1]
    total, parts, m = 0.0, {}, h
    for j, weight in enumerate(s.depth_weights, start=1):
        m = head(m[:, : T - j], emb[:, j:])
        q = lm_logits(trainee, m, True).float().flatten(0, 1)
        p = teacher[:, j:].flatten(0, 1)
        soft = -(p.softmax(-1) * q.log_softmax(-1)).sum(-1).mean()
        hard = F.cross_entropy(q, p.argmax(-1))
        loss = s.hard_weight * hard + (1 - s.hard_weight) * soft
        total = total + weight * loss
        parts[f"d{j}"] = loss
    return total / sum(s.depth_weights), parts


def distill(source: Path, data: Path, out: Path, settings: DistillSettings, resume: Path | None, log: Log) -> Path:
    """Distill the head of ``source`` (a fit checkpoint) into ``out``."""
    config, _, _ = read_checkpoint(source, with_optimizer=False)
    run = Run("distill", config, settings, out, log, trainable="head")
    run.resume(resume or source)
    dev = run.dev
    train = torch.from_numpy(load_tokens(data, "train").astype(np.int32)).to(dev)
    held = torch.from_numpy(load_tokens(data, "heldout").astype(np.int32))
    trunk = run.trainee.trunk.eval()
    s = settings
    pool: dict = {}

    def regenerate(step: int) -> None:
        started = time.monotonic()
        g = torch.Generator(device=dev).manual_seed(s.seed * 7919 + step)
        per = max(1, s.pool_sequences // len(s.temperatures))
        parts = []
        for i, t in enumerate(s.temperatures):
            starts = batch_starts(len(train), s.prefix_len, per, s.seed + 17 * (i + 1), step).to(dev)
            for chunk in torch.split(windows(train, starts, s.prefix_len), 1024):
                parts.append(continue_text(trunk, chunk, s.seq_len - s.prefix_len, t, g))
        pool["sequences"] = torch.cat(parts)
        log(f"distill: {len(pool['sequences'])} trunk continuations (temperatures {list(s.temperatures)}) "
            f"in {time.monotonic() - started:.1f} s")

    def next_batch(step):
        if step % s.regenerate_every == 0 or "sequences" not in pool:
            regenerate(step - step % s.regenerate_every)
        g = torch.Generator().manual_seed(s.seed * 1_000_003 + step)
        n_corpus = int(round(s.batch_size * s.corpus_fraction))
        rows = torch.randint(0, len(pool["sequences"]), (s.batch_size - n_corpus,), generator=g)
        generated = pool["sequences"][rows.to(dev)]
        corpus = windows(train, batch_starts(len(train), s.seq_len, n_corpus, s.seed, step).to(dev), s.seq_len)
        return torch.cat([generated, corpus])

    run.loop(next_batch, lambda x: distill_losses(run.trainee, x, s),
             lambda: evaluate(run.trainee, held, s.seq_len, dev))
    return out


def settings_from(cls, values: dict):
    """A settings dataclass from a dict (tuples restored), ValueError on unknown keys."""
    unknown = sorted(set(values) - set(cls.__dataclass_fields__))
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields: {unknown}")
    fixed = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return cls(**fixed)

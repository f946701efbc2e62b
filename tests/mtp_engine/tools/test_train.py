"""Training the shipped model (`mtp_engine.tools.train`, PyTorch): the PyTorch
model computes what the MLX model computes on the same weights, checkpoints
are atomic, a run killed mid-way and resumed ends with exactly the weights of
an uninterrupted run, distillation changes only the head, and an exported
run loads into the engine and decodes losslessly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mlx.core as mx  # noqa: E402

from mtp_engine.tools.train.__main__ import model_config  # noqa: E402
from mtp_engine.tools.train.checkpoint import (  # noqa: E402
    latest_step,
    load_file,
    read_checkpoint,
    save_file,
    write_portable,
    write_step,
)
from mtp_engine.tools.train.export import load_into_mlx  # noqa: E402
from mtp_engine.tools.train.torch_model import Trainee, gated_delta_chunked, gated_delta_steps  # noqa: E402
from mtp_engine.tools.train.trainer import (  # noqa: E402
    DistillSettings,
    FitSettings,
    Log,
    distill,
    evaluate,
    fit,
    loop_mask,
    unlikelihood_loss,
)

ROOT = Path(__file__).resolve().parents[3]
TINY = dict(hidden_size=64, num_attention_heads=2, linear_num_value_heads=2, linear_num_key_heads=1, head_dim=32,
            linear_key_head_dim=32, linear_value_head_dim=32, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, num_hidden_layers=4, vocab_size=384)
TINY_JSON = json.dumps(TINY)


def tiny_config() -> dict:
    return model_config("small", TINY_JSON)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Token arrays with structure: a repeated motif with some noise."""
    folder = tmp_path_factory.mktemp("train-data")
    rng = np.random.default_rng(0)
    motif = rng.integers(3, 384, 40)
    tokens = np.tile(motif, 200)
    noise = rng.random(tokens.size) < 0.05
    tokens[noise] = rng.integers(3, 384, noise.sum())
    np.save(folder / "train.npy", tokens.astype(np.uint16))
    np.save(folder / "heldout.npy", tokens[:2000].astype(np.uint16))
    return folder


def test_chunked_recurrence_equals_the_step_by_step_rule():
    g = torch.Generator().manual_seed(0)
    B, T, H, Dk, Dv = 2, 150, 3, 16, 8  # T not a multiple of the chunk
    q = torch.randn(B, T, H, Dk, generator=g, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, Dk, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, Dv, generator=g, dtype=torch.float64)
    log_g = -torch.rand(B, T, H, generator=g, dtype=torch.float64)
    beta = torch.rand(B, T, H, generator=g, dtype=torch.float64)
    state = torch.randn(B, H, Dk, Dv, generator=g, dtype=torch.float64)
    o1, s1 = gated_delta_steps(q, k, v, log_g, beta, state)
    o2, s2 = gated_delta_chunked(q, k, v, log_g, beta, state, chunk=32)
    assert torch.allclose(o1, o2, atol=1e-12) and torch.allclose(s1, s2, atol=1e-12)


def test_torch_model_computes_what_the_mlx_model_computes():
    config = tiny_config()
    torch.manual_seed(1)
    trainee = Trainee(config).eval()
    with torch.no_grad():  # norms and biases away from their initial ones
        for p in trainee.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    model, head = load_into_mlx(config, {n: p.detach().numpy() for n, p in trainee.named_parameters()})
    trainee = trainee.double()
    x = np.random.default_rng(0).integers(0, config["vocab_size"], (2, 70))
    with torch.no_grad():
        hidden = trainee.trunk.hidden(torch.tensor(x))
        logits = trainee.trunk.lm_head(hidden).numpy()
        m = trainee.head(hidden[:, :-1], trainee.trunk.model.embed_tokens(torch.tensor(x))[:, 1:]).numpy()
        cache = trainee.trunk.make_cache(80)
        steps = [trainee.trunk(torch.tensor(x[:, :40]), cache)]
        steps += [trainee.trunk(torch.tensor(x[:, t : t + 1]), cache) for t in range(40, 70)]
        incremental = torch.cat(steps, dim=1).numpy()
    h_mlx = model.model(mx.array(x))
    logits_mlx = np.array(model.lm_head(h_mlx))
    m_mlx = np.array(head(h_mlx[:, :-1], model.model.embed_tokens(mx.array(x))[:, 1:], None))
    scale = np.abs(logits).max()
    assert np.abs(logits_mlx - logits).max() < 1e-4 * scale  # float32 (MLX) against float64
    assert np.abs(m_mlx - m).max() < 1e-4 * np.abs(m).max()
    assert np.abs(incremental - logits).max() < 1e-9 * scale  # decoding with caches = the whole sequence


def test_checkpoint_steps_are_atomic_and_files_small(tmp_path):
    config = {"model_type": "qwen3_next"}
    big = {"a": np.arange(5_000_000, dtype=np.float32), "b": np.ones((3, 4), np.float32)}
    write_step(tmp_path, config, 1, big, None, {"kind": "fit"})
    first = latest_step(tmp_path)
    assert all(p.stat().st_size <= 16 * 2**20 for p in first.iterdir())
    # A kill while writing step 2 leaves its partial folder, which is never read.
    (tmp_path / ".step-00000002.partial").mkdir()
    (tmp_path / "step-00000003").mkdir()  # no progress.json: incomplete
    assert latest_step(tmp_path) == first
    _, weights, progress = read_checkpoint(tmp_path)
    assert progress["step"] == 1 and np.array_equal(weights["a"], big["a"])
    write_step(tmp_path, config, 4, {"a": big["a"] + 1}, {"a.exp_avg": big["a"]}, {"kind": "fit"})
    assert latest_step(tmp_path).name == "step-00000004" and not first.exists()
    portable = write_portable(latest_step(tmp_path), tmp_path / "portable")
    _, moved, _ = read_checkpoint(tmp_path / "portable")
    assert sum(p.stat().st_size for p in portable) < 0.6 * big["a"].nbytes
    assert np.allclose(moved["a"], big["a"] + 1, rtol=2**-8)  # bfloat16
    save_file(tmp_path / "cut.safetensors", {"x": np.ones(1000, np.float32)})
    raw = (tmp_path / "cut.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(raw[:-100])
    with pytest.raises(ValueError, match="truncated"):
        load_file(tmp_path / "cut.safetensors")


def _fit(out: Path, data: Path, steps: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "mtp_engine.train", "fit", "--preset", "small", "--config-overrides", TINY_JSON,
            "--data", str(data), "--out", str(out), "--seq-len", "32", "--batch-size", "4", "--steps", str(steps),
            "--warmup", "3", "--eval-every", "1000", "--log-every", "1", "--checkpoint-minutes", "0", *extra]


def test_fit_killed_and_resumed_ends_as_an_uninterrupted_run(tmp_path, data):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    whole = tmp_path / "whole"
    subprocess.run(_fit(whole, data, 14), check=True, env=env, capture_output=True, cwd=ROOT)

    cut = tmp_path / "cut"
    started = subprocess.run(_fit(cut, data, 14, "--detach"), check=True, env=env, capture_output=True,
                             text=True, cwd=ROOT).stdout
    pid = int(started.split("pid ")[1].split(",")[0])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # SIGKILL the detached run's session after a few steps
        step = latest_step(cut)
        if step is not None and json.loads((step / "progress.json").read_text())["step"] >= 4:
            break
        time.sleep(0.05)
    os.killpg(pid, signal.SIGKILL)
    _, _, killed_at = read_checkpoint(cut, with_optimizer=False)
    assert 4 <= killed_at["step"] < 14, "the run finished before it was killed"
    log = (cut / "train.log").read_text()
    assert "fit step 1 " in log  # the detached run logged to its file

    subprocess.run(_fit(cut, data, 14, "--resume", str(cut)), check=True, env=env, capture_output=True, cwd=ROOT)
    assert "optimizer state restored" in (cut / "train.log").read_text()
    _, a, pa = read_checkpoint(whole, with_optimizer=False)
    _, b, pb = read_checkpoint(cut, with_optimizer=False)
    assert pa["step"] == pb["step"] == 14 and pa["tokens"] == pb["tokens"]
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_resume_from_nothing_is_a_clear_error(tmp_path, data):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(_fit(tmp_path / "x", data, 2, "--resume", str(tmp_path / "missing")), env=env,
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode != 0 and "no checkpoint step" in r.stderr and "Traceback" not in r.stderr


def test_loop_mask_marks_a_cycle_from_its_third_time_round():
    prefix = list(range(100, 110))
    looped = torch.tensor([prefix + [5, 6, 7] * 12])  # a period-3 loop after 10 tokens
    mask = loop_mask(looped)[0].tolist()
    assert mask == [False] * 16 + [True] * 30  # the cycle's first two passes are not penalized
    assert not loop_mask(looped, start=46).any()
    twice = torch.tensor([prefix + [5, 6, 7, 8, 9, 10, 11, 12] * 2 + list(range(200, 230))])
    assert not loop_mask(twice).any()  # a line written twice is no loop
    assert not loop_mask(torch.arange(60)[None]).any()


def test_unlikelihood_lowers_the_looping_tokens_and_the_tune_logs_its_loop_rate(tmp_path, data, fitted):
    config, weights, _ = read_checkpoint(fitted, with_optimizer=False)
    trainee = Trainee(config)
    trainee.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    x = torch.tensor([list(range(3, 13)) + [20, 21, 22, 23] * 8])
    mask = loop_mask(x)

    def looping_probability():
        with torch.no_grad():
            p = trainee.trunk.lm_head(trainee.trunk.hidden(x[:, :-1])).softmax(-1)
            return p.gather(-1, x[:, 1:, None])[..., 0][mask[:, 1:]].mean().item()

    before = looping_probability()
    opt = torch.optim.SGD(trainee.trunk.parameters(), lr=0.5)
    for _ in range(5):
        opt.zero_grad()
        unlikelihood_loss(trainee.trunk, x, mask).backward()
        opt.step()
    assert looping_probability() < before

    settings = FitSettings(seq_len=32, batch_size=4, steps=34, lr=1e-3, warmup=1, unlikelihood=1.0, ul_batch=4,
                           prefix_len=8, new_tokens=40, pool_sequences=16, regenerate_every=2, eval_every=1000,
                           checkpoint_minutes=60, compile=False)
    fit(config, data, tmp_path / "tune", settings, fitted, Log(None))  # the fit continues, with unlikelihood
    _, _, progress = read_checkpoint(tmp_path / "tune", with_optimizer=False)
    assert progress["step"] == 34 and 0.0 <= progress["history"][-1]["pool_loop_rate"] <= 1.0
    with pytest.raises(ValueError, match="unlikelihood"):
        FitSettings(unlikelihood=-1.0)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, data) -> Path:
    out = tmp_path_factory.mktemp("fitted")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(_fit(out, data, 30, "--lr", "3e-3"), check=True, env=env, capture_output=True, cwd=ROOT)
    return out


def test_distill_changes_only_the_head_and_it_agrees_more(tmp_path, data, fitted):
    settings = DistillSettings(seq_len=32, batch_size=8, steps=40, lr=3e-3, warmup=2, prefix_len=8,
                               pool_sequences=24, regenerate_every=20, eval_every=1000, log_every=10,
                               checkpoint_minutes=60, depth_weights=(1.0, 0.5), compile=False)
    config, before, _ = read_checkpoint(fitted, with_optimizer=False)
    trainee = Trainee(config)
    trainee.load_state_dict({k: torch.from_numpy(v) for k, v in before.items()})
    held = torch.from_numpy(np.load(data / "heldout.npy").astype(np.int32))
    agree_before = evaluate(trainee, held, 32, torch.device("cpu"), depth=2)
    distill(fitted, data, tmp_path / "d", settings, None, Log(None))
    _, after, progress = read_checkpoint(tmp_path / "d", with_optimizer=False)
    assert all(np.array_equal(before[k], after[k]) for k in before if k.startswith("trunk."))
    assert any(not np.array_equal(before[k], after[k]) for k in before if k.startswith("head."))
    agree_after = progress["history"][-1]
    assert agree_after["head1_trunk_acc"] > agree_before["head1_trunk_acc"]
    assert agree_after["perplexity"] == agree_before["perplexity"]


def test_exported_run_loads_and_decodes_losslessly(tmp_path, data, fitted):
    from tokenizers import Tokenizer

    from mtp_engine import MTPEngine
    from mtp_engine.io.tiny import tiny_tokenizer
    from mtp_engine.tools.train.export import export_checkpoint

    tokenizer = tmp_path / "tokenizer.json"
    tiny_tokenizer(384).save(str(tokenizer))
    assert Tokenizer.from_file(str(tokenizer)).get_vocab_size() <= 384
    out = export_checkpoint(fitted, tmp_path / "model", tokenizer)
    _, trained, _ = read_checkpoint(fitted, with_optimizer=False)
    _, exported, progress = read_checkpoint(out)  # a model folder reads back as a checkpoint (weights only)
    assert progress["kind"] == "model" and set(exported) == set(trained)
    assert [r["kind"] for r in progress["runs"]] == ["fit"]  # a run started from the model records what made it
    assert all(np.allclose(exported[k], trained[k], rtol=2**-7, atol=1e-6) for k in trained)  # bfloat16
    engine = MTPEngine.load(out)
    prompt = [int(t) for t in np.load(data / "heldout.npy")[:20]]
    plain = engine.generate(prompt, max_tokens=40, mode="baseline")
    chain = engine.generate(prompt, max_tokens=40, mode="chain", draft_tokens=3)
    assert chain.tokens == plain.tokens
    assert chain.stats.accepted > 0  # the fitted head learned the motif

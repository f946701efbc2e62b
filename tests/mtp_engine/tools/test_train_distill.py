"""Self-distilling the MTP head: only the head changes, the trunk (and so
greedy output) is untouched, and the head comes to agree with the trunk."""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mtp_engine import MTPEngine
from mtp_engine.io.hub_writer import replace_mtp_head
from mtp_engine.io.tiny import make_tiny_checkpoint, tiny_config
from mtp_engine.io.weights import weight_files
from mtp_engine.model.loader import load_checkpoint
from mtp_engine.model.mtp_head import MTPHead
from mtp_engine.options import EngineOptions
from mtp_engine.tools.train.__main__ import main as train_main
from mtp_engine.tools.train.distill import DistillSettings, distill

SETTINGS = dict(seq_len=32, batch_size=8, lr=3e-3, warmup=2, depth_weights=(1.0, 0.5),
                generated_fraction=0.5, prefix_len=8, eval_every=1000)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    # Sharded, so one shard holds no head tensor and must be copied as is.
    return make_tiny_checkpoint(tmp_path_factory.mktemp("distill-src"), tiny_config(), seed=4,
                                max_shard_bytes=200_000)


@pytest.fixture(scope="module")
def tokens() -> np.ndarray:
    # A repeated 40-token motif: text with structure, like the loops greedy
    # output falls into, which a random trunk's predictions then follow.
    motif = np.random.default_rng(0).integers(3, 384, 40)
    return np.tile(motif, 150).astype(np.int32)


def tensors(folder: Path) -> dict[str, mx.array]:
    out = {}
    for path in weight_files(folder):
        out.update(mx.load(str(path)))
    return out


def test_replace_mtp_head_changes_only_the_head(source, tmp_path):
    loaded = load_checkpoint(source, options=EngineOptions(compile_layers=False))
    head = loaded.head
    head.fc.weight = head.fc.weight + 0.5
    head.pre_fc_norm_hidden.weight = head.pre_fc_norm_hidden.weight * 2  # stored zero-centred
    out = tmp_path / "out"
    written = replace_mtp_head(source, out, head)

    before, after = tensors(source), tensors(out)
    assert set(before) == set(after)
    changed = {k for k in before if not mx.array_equal(before[k], after[k]).item()}
    assert changed and all(k.startswith("mtp.") for k in changed)
    for path in weight_files(source):  # shards without head tensors: byte for byte
        if out / path.name not in written:
            assert filecmp.cmp(path, out / path.name, shallow=False)
    assert not (out / ".mtp-head-staging").exists()

    reloaded = load_checkpoint(out, options=EngineOptions(compile_layers=False)).head
    for (name, new), (_, want) in zip(tree_flatten(reloaded.parameters()), tree_flatten(head.parameters())):
        assert mx.allclose(new, want, atol=1e-6).item(), name


def test_replace_mtp_head_rejects_a_head_of_another_shape(source, tmp_path):
    loaded = load_checkpoint(source, options=EngineOptions(compile_layers=False))
    two_layers = MTPHead(loaded.model.args, num_layers=2)
    with pytest.raises(ValueError, match="do not match"):
        replace_mtp_head(source, tmp_path / "out", two_layers)
    assert not (tmp_path / "out").exists()


def test_distill_raises_agreement_and_leaves_the_trunk(source, tokens):
    loaded = load_checkpoint(source, options=EngineOptions(compile_layers=False))
    trunk_before = {k: mx.array(v) for k, v in tree_flatten(loaded.model.parameters())}
    history = distill(loaded.model, loaded.head, tokens, tokens[:2000],
                      DistillSettings(steps=40, **SETTINGS), log=lambda m: None)
    first, last = history[0], history[-1]
    assert last["step"] == 40
    # The random head agrees with the trunk by chance only (0.006 when
    # written); 40 steps teach it (0.73).
    assert first["agree1"] < 0.1 and last["agree1"] > 0.4, history
    assert last["loss1"] < first["loss1"]
    for k, v in tree_flatten(loaded.model.parameters()):
        assert mx.array_equal(v, trunk_before[k]).item(), k


@pytest.mark.parametrize("bad, message", [
    (dict(hard_weight=1.5), "hard_weight"),
    (dict(generated_fraction=-0.1), "generated_fraction"),
    (dict(depth_weights=()), "depth"),
])
def test_distill_names_a_bad_setting(source, tokens, bad, message):
    loaded = load_checkpoint(source, options=EngineOptions(compile_layers=False))
    with pytest.raises(ValueError, match=message):
        distill(loaded.model, loaded.head, tokens, tokens, DistillSettings(**{**SETTINGS, **bad}),
                log=lambda m: None)


def test_distill_command_keeps_greedy_output_and_records_runs(source, tokens, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    np.save(data / "train.npy", tokens)
    np.save(data / "heldout.npy", tokens[:2000])
    out = tmp_path / "distilled"
    args = ["distill", "--model", str(source), "--data", str(data), "--out", str(out), "--steps", "3",
            "--batch-size", "4", "--seq-len", "32", "--prefix-len", "8", "--depth-weights", "1,0.5"]
    train_main(args)
    train_main(args[:2] + [str(out)] + args[3:])  # a second run, in place, from the first's head
    runs = json.loads((out / "training.json").read_text())["head_distillation"]
    assert [r["steps_done"] for r in runs] == [3, 3]
    assert runs[0]["settings"]["depth_weights"] == [1.0, 0.5]

    src_engine, new_engine = MTPEngine.load(source), MTPEngine.load(out)
    ids = src_engine.encode("def add(a, b):")
    plain = src_engine.generate(ids, max_tokens=24, mode="baseline").tokens
    assert new_engine.generate(ids, max_tokens=24, mode="baseline").tokens == plain
    assert new_engine.generate(ids, max_tokens=24, mode="chain", draft_tokens=2).tokens == plain


@pytest.mark.parametrize("extra, message", [
    (["--hard-weight", "2"], "hard_weight must be in"),
    (["--depth-weights", "1,x"], "--depth-weights must be comma-separated numbers, got '1,x'"),
    (["--data", "/nonexistent/data"], "train.npy not found"),
])
def test_distill_command_names_a_bad_argument(source, tmp_path, extra, message):
    args = ["distill", "--model", str(source), "--out", str(tmp_path / "out"), "--data", str(tmp_path)] + extra
    with pytest.raises(SystemExit) as info:
        train_main(args)
    assert message in str(info.value)
    assert not (tmp_path / "out").exists()

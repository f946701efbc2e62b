"""`python -m mtp_engine.convert`: quantized folders that keep their MTP head."""

from __future__ import annotations

import shutil

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.convert import convert as mlx_lm_convert
from mlx_lm.utils import load as mlx_lm_load

from mtp_engine import CheckpointError, MTPEngine
from mtp_engine.io.convert import main as convert_main
from mtp_engine.io.tiny import make_tiny_checkpoint, tiny_config, tiny_qwen35_config
from mtp_engine.weights import MTP_FILE, files_with_prefix
from tests.conftest import PROMPTS
from tests.mtp_engine.test_lossless import check_against_reference

CONFIG = tiny_config(moe_intermediate_size=64, shared_expert_intermediate_size=64)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    # Sharded, so the graft can be shown to read only the shards with mtp.*.
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("hub") / "m", CONFIG, seed=11, predictability=0.4, max_shard_bytes=400_000
    )


@pytest.fixture(scope="module")
def converted(tmp_path_factory, hub):
    out = tmp_path_factory.mktemp("conv") / "q4"
    code = convert_main(["--hf-path", str(hub), "--mlx-path", str(out), "-q", "--q-bits", "4",
                         "--q-group-size", "32", "--mtp-bits", "8"])
    assert code == 0
    return out


def test_converted_folder_loads_in_mlx_lm_and_the_engine(converted):
    model, _ = mlx_lm_load(str(converted))  # unchanged mlx-lm loading
    assert isinstance(model.model.layers[0].mlp.switch_mlp.gate_proj, nn.Module)
    engine = MTPEngine.load(converted)
    head = engine.checkpoint.head
    assert isinstance(head.fc, nn.QuantizedLinear) and head.fc.bits == 8
    assert engine.model.model.layers[0].linear_attn.in_proj_qkvz.bits == 4
    assert (converted / MTP_FILE).exists()


def assert_chain_and_tree_lossless(folder, reference_factory, prompts: list[str], n_tokens: int) -> MTPEngine:
    """Chain and tree decoding of a converted folder equal mlx-lm's greedy
    decoding of it (its own classes, its own loader), with drafts accepted."""
    engine = MTPEngine.load(folder)
    reference = reference_factory(folder)
    accepted = 0
    for prompt in prompts:
        ids = engine.encode(prompt)
        ref, gaps = reference.greedy(ids, n_tokens)
        for mode in ("chain", "tree"):
            result = engine.generate(ids, max_tokens=n_tokens, mode=mode)
            check_against_reference(result, ref, gaps, engine.eos_token_ids, n_tokens)
            accepted += result.stats.accepted
    assert accepted > 0
    return engine


def test_lossless_per_converted_folder(converted, reference_factory):
    assert_chain_and_tree_lossless(converted, reference_factory, PROMPTS[:6], 40)


def test_graft_equals_one_step_conversion(tmp_path, hub, converted):
    # The graft reads only the shards holding mtp.*: remove the others.
    sparse = tmp_path / "hub_mtp_only"
    shutil.copytree(hub, sparse)
    keep = set(files_with_prefix(hub, "mtp."))
    assert 0 < len(keep) < len(list(hub.glob("model-*.safetensors")))
    trunk_only = tmp_path / "trunk"
    mlx_lm_convert(str(hub), str(trunk_only), quantize=True, q_bits=4, q_group_size=32)
    for f in sparse.glob("model-*.safetensors"):
        if hub / f.name not in keep:
            f.unlink()
    code = convert_main(["--add-mtp-from", str(sparse), "--mlx-path", str(trunk_only),
                         "--q-group-size", "32", "--mtp-bits", "8"])
    assert code == 0
    a = mx.load(str(converted / MTP_FILE))
    b = mx.load(str(trunk_only / MTP_FILE))
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]) for k in a)
    one, two = MTPEngine.load(converted), MTPEngine.load(trunk_only)
    for prompt in PROMPTS[:3]:
        ra, rb = one.generate(prompt, max_tokens=24), two.generate(prompt, max_tokens=24)
        assert ra.tokens == rb.tokens and ra.stats.histogram == rb.stats.histogram


def test_head_from_another_model_is_refused(tmp_path, converted, capsys):
    other = make_tiny_checkpoint(tmp_path / "other", tiny_config(hidden_size=96, linear_key_head_dim=24), seed=3)
    before = (converted / MTP_FILE).read_bytes()
    code = convert_main(["--add-mtp-from", str(other), "--mlx-path", str(converted)])
    assert code == 1
    err = capsys.readouterr().err
    assert "different model" in err and "hidden_size: 96" in err
    assert (converted / MTP_FILE).read_bytes() == before
    from mtp_engine.io.convert import graft

    with pytest.raises(CheckpointError, match=r"different model[\s\S]*hidden_size: 96"):
        graft(other, converted, mtp_bits=8, group_size=32, dtype=None)


def test_unquantized_head_option(tmp_path, hub):
    out = tmp_path / "q4-float-head"
    assert convert_main(["--hf-path", str(hub), "--mlx-path", str(out), "-q", "--q-group-size", "32",
                         "--mtp-bits", "none", "--dtype", "float32"]) == 0
    head = MTPEngine.load(out).checkpoint.head
    assert isinstance(head.fc, nn.Linear) and head.fc.weight.dtype == mx.float32


def test_source_without_head_is_refused(tmp_path):
    headless = make_tiny_checkpoint(tmp_path / "headless", CONFIG, with_mtp=False)
    assert convert_main(["--hf-path", str(headless), "--mlx-path", str(tmp_path / "out")]) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("moe", [True, False], ids=["qwen3_5_moe", "qwen3_5"])
def test_qwen35_conversion_keeps_the_head_and_is_lossless(tmp_path, reference_factory, moe):
    hub = make_tiny_checkpoint(tmp_path / "hub", tiny_qwen35_config(moe=moe), seed=12, predictability=0.4)
    out = tmp_path / "q4"
    assert convert_main(["--hf-path", str(hub), "--mlx-path", str(out), "-q", "--q-bits", "4",
                         "--q-group-size", "32", "--mtp-bits", "8"]) == 0
    engine = assert_chain_and_tree_lossless(out, reference_factory, PROMPTS[:4], 32)
    assert isinstance(engine.checkpoint.head.fc, nn.QuantizedLinear) and engine.checkpoint.head.fc.bits == 8
    assert engine.model.layers[0].linear_attn.in_proj_qkv.bits == 4
    # A head from a Qwen3.5 model of another shape is refused.
    other = make_tiny_checkpoint(tmp_path / "other", tiny_qwen35_config(moe=moe, hidden_size=96), seed=3)
    with pytest.raises(CheckpointError, match=r"different model[\s\S]*hidden_size: 96"):
        from mtp_engine.io.convert import graft

        graft(other, out, mtp_bits=8, group_size=32, dtype=None)

"""Qwen3.5, dense and MoE, in the layouts the Hub ships.

- Every mode, batched speculation and the exact sampler equal mlx-lm's own
  decoding of the same folder (`mlx_lm.load` + `generate_step`: its
  ``qwen3_5`` / ``qwen3_5_moe`` classes), token for token, on tiny configs
  varying depth, ``full_attention_interval``, the linear key/value head
  ratio, experts, tied embeddings and RoPE settings (near-tie rule of
  tests/mtp_engine/test_lossless.py).
- The vision-language layout and the text-only one, fused experts and one
  tensor per expert, single file and shards: the same weights give the same
  output.
- The engine's layers cover Qwen3.5's gated-delta layers; clear errors for a
  folder it cannot use.
"""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from jobs.cli import main as jobs_main
from mtp_engine import CheckpointError, MissingMTPHeadError, MTPEngine
from mtp_engine.decoder import Decoder
from mtp_engine.modes import DecodeConfig
from mtp_engine.io.tiny import make_tiny_checkpoint, tiny_qwen35_config
from mtp_engine.weights import read_safetensors_header, weight_files
from mtp_engine.model.gated_delta import CapturingQwen35GatedDeltaNet
from mtp_engine.sampling import SamplingParams
from tests.conftest import PROMPTS
from tests.mtp_engine.test_lossless import N_TOKENS, check_against_reference
from tests.mtp_engine.test_sampling import PlainSampler, assert_same_or_near_tie

CONFIGS = {
    "q35_dense_l4_fai4_kv2": (tiny_qwen35_config(), dict(seed=31, predictability=0.4)),
    "q35_moe_l6_fai3_kv1_e8k3_rope1e6": (
        tiny_qwen35_config(
            moe=True, num_hidden_layers=6, full_attention_interval=3, linear_num_key_heads=4,
            linear_num_value_heads=4, num_experts=8, num_experts_per_tok=3, norm_topk_prob=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
        ),
        dict(seed=32, predictability=0.35),
    ),
    "q35_dense_l5_fai5_kv4_tied_linear_rope": (
        tiny_qwen35_config(
            num_hidden_layers=5, full_attention_interval=5, linear_num_value_heads=8, tie_word_embeddings=True,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4, "partial_rotary_factor": 0.25},
        ),
        dict(seed=33),  # tied: random weights (no planted structure)
    ),
    "q35_moe_text_l8_fai2_kv4_mtp2": (
        tiny_qwen35_config(
            moe=True, layout="text", num_hidden_layers=8, full_attention_interval=2, linear_num_value_heads=8,
            hidden_size=96, linear_key_head_dim=24, mtp_num_hidden_layers=2,
        ),
        dict(seed=34, predictability=0.45),
    ),
}

# Every single-sequence mode on every config, K and P varying; then batched
# speculation (B, K).
MODE_PARAMS = {
    "q35_dense_l4_fai4_kv2": [
        dict(mode="baseline"), dict(mode="chain", draft_tokens=3), dict(mode="adaptive", draft_tokens=4, tau=0.5),
        dict(mode="tree", draft_tokens=3), dict(mode="adaptive_tree", draft_tokens=4, tau=0.3),
        dict(mode="paths", draft_tokens=3, paths=2),
    ],
    "q35_moe_l6_fai3_kv1_e8k3_rope1e6": [
        dict(mode="chain", draft_tokens=1), dict(mode="chain", draft_tokens=5), dict(mode="adaptive", draft_tokens=3),
        dict(mode="tree", draft_tokens=2, tree_pos2=False), dict(mode="adaptive_tree", draft_tokens=3, tau=0.5),
        dict(mode="paths", draft_tokens=2, paths=4),
    ],
    "q35_dense_l5_fai5_kv4_tied_linear_rope": [
        dict(mode="chain", draft_tokens=2), dict(mode="adaptive", draft_tokens=3, tau=0.2),
        dict(mode="tree", draft_tokens=1), dict(mode="adaptive_tree", draft_tokens=2, tau=0.01),
        dict(mode="paths", draft_tokens=3, paths=3),
    ],
    "q35_moe_text_l8_fai2_kv4_mtp2": [
        dict(mode="chain", draft_tokens=4), dict(mode="adaptive", draft_tokens=5, tau=0.8),
        dict(mode="tree", draft_tokens=4), dict(mode="adaptive_tree", draft_tokens=5, tau=0.1),
        dict(mode="paths", draft_tokens=3, paths=1),
    ],
}
BATCHED = {"q35_dense_l4_fai4_kv2": (5, 3), "q35_moe_l6_fai3_kv1_e8k3_rope1e6": (16, 2),
           "q35_dense_l5_fai5_kv4_tied_linear_rope": (3, 6), "q35_moe_text_l8_fai2_kv4_mtp2": (8, 4)}


@pytest.fixture(scope="module")
def loaded(checkpoint_factory, reference_factory):
    out = {}

    def get(name):
        if name not in out:
            config, kwargs = CONFIGS[name]
            path = checkpoint_factory(name, config, **kwargs)
            out[name] = (path, MTPEngine.load(path), reference_factory(path))
        return out[name]

    return get


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_mode_and_batched_speculation_match_mlx_lm_greedy(name, loaded, capsys):
    path, engine, reference = loaded(name)
    eos = engine.eos_token_ids
    counts = {"identical": 0, "near_tie": 0}
    accepted = 0
    refs = []
    for prompt in PROMPTS:
        ids = engine.encode(prompt)
        ref_tokens, ref_gaps = reference.greedy(ids, N_TOKENS)
        refs.append((ref_tokens, ref_gaps))
        for params in MODE_PARAMS[name]:
            result = engine.generate(ids, max_tokens=N_TOKENS, **params)
            counts[check_against_reference(result, ref_tokens, ref_gaps, eos)] += 1
            accepted += result.stats.accepted
    batch_size, k = BATCHED[name]
    results = engine.generate_batch(PROMPTS, batch_size=batch_size, max_tokens=N_TOKENS, mode="chain",
                                    draft_tokens=k)
    for result, (ref_tokens, ref_gaps) in zip(results, refs):
        counts[check_against_reference(result, ref_tokens, ref_gaps, eos)] += 1
        accepted += result.stats.accepted
    with capsys.disabled():
        print(f"\n[lossless {name}] identical={counts['identical']} near_ties={counts['near_tie']}")
    assert sum(counts.values()) == len(PROMPTS) * (len(MODE_PARAMS[name]) + 1)
    if CONFIGS[name][1].get("predictability"):
        assert accepted > 0  # drafts landed: commits of accepted prefixes were exercised


@pytest.mark.parametrize("name", ["q35_dense_l4_fai4_kv2", "q35_moe_l6_fai3_kv1_e8k3_rope1e6"])
def test_exact_sampler_equals_plain_sampling_of_mlx_lm(name, loaded):
    path, engine, _ = loaded(name)
    plain = PlainSampler(path)
    setting = dict(temperature=0.9, top_p=0.95)
    rows = []
    for i, prompt in enumerate(PROMPTS[:4]):
        ids = engine.encode(prompt)
        params = SamplingParams(seed=500 + i, **setting)
        reference = plain.sample(ids, params, 40)
        for mode, kw in [("chain", dict(draft_tokens=3)), ("tree", dict(draft_tokens=3))]:
            result = engine.generate(ids, mode=mode, max_tokens=40, seed=500 + i, **setting, **kw)
            assert_same_or_near_tie(f"{name} {mode} prompt {i}", result.tokens, reference, params)
        rows.append((i, ids, params, reference))
    decoder = Decoder(engine, DecodeConfig(draft_tokens=2, batch_size=3))
    for i, ids, params, _ in rows:
        decoder.add(i, ids, [params], max_tokens=40)
    results = {}
    while decoder.pending:
        results.update({key: r for (key, _), r in decoder.step()})
    for i, _, params, reference in rows:
        assert_same_or_near_tie(f"{name} batched row {i}", results[i].tokens, reference, params)


def test_engine_layers_cover_qwen35_gated_delta(loaded):
    _, dense, _ = loaded("q35_dense_l4_fai4_kv2")
    _, moe, _ = loaded("q35_moe_l6_fai3_kv1_e8k3_rope1e6")
    for engine in (dense, moe):
        linear = [layer.linear_attn for layer in engine.model.layers if layer.is_linear]
        assert linear and all(isinstance(a, CapturingQwen35GatedDeltaNet) for a in linear)
        states = {s.name: s.state for s in engine.fast_paths}
        if mx.default_device() == mx.cpu:
            assert states["cpu_recurrence"] == states["compile_layers"] == "on"
    # The C++ drafter runs MoE heads; a dense head says why it cannot.
    cpp = {e: next(s for s in e.fast_paths if s.name == "cpp_drafter") for e in (dense, moe)}
    if mx.default_device() == mx.cpu:
        assert cpp[moe].state == "on"
        assert cpp[dense].state == "unavailable" and "dense MLP" in cpp[dense].detail


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """One MoE model's weights written four ways."""
    root = tmp_path_factory.mktemp("layouts")
    kw = dict(seed=41, predictability=0.4)
    return {
        "vl fused": make_tiny_checkpoint(root / "vl", tiny_qwen35_config(moe=True), **kw),
        "text fused": make_tiny_checkpoint(root / "text", tiny_qwen35_config(moe=True, layout="text"), **kw),
        "vl per-expert sharded": make_tiny_checkpoint(root / "vl-pe", tiny_qwen35_config(moe=True), per_expert=True,
                                                      max_shard_bytes=150_000, **kw),
        "text per-expert": make_tiny_checkpoint(root / "text-pe", tiny_qwen35_config(moe=True, layout="text"),
                                                per_expert=True, **kw),
    }


def _keys(folder) -> set[str]:
    return {k for f in weight_files(folder) for k in read_safetensors_header(f) if k != "__metadata__"}


def test_layouts_hold_the_hub_names(layouts):
    vl, text = _keys(layouts["vl fused"]), _keys(layouts["text per-expert"])
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in vl
    assert any(k.startswith("model.visual.") for k in vl) and "lm_head.weight" in vl
    assert "mtp.layers.0.mlp.experts.gate_up_proj" in vl and "model.language_model.layers.0.mlp.experts.down_proj" in vl
    assert "model.layers.0.linear_attn.in_proj_z.weight" in text
    assert "mtp.layers.0.mlp.experts.3.gate_proj.weight" in text and not any("visual" in k for k in text)
    config = json.loads((layouts["vl fused"] / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe" and "text_config" in config and "vision_config" in config
    assert (layouts["vl per-expert sharded"] / "model.safetensors.index.json").exists()


def test_every_layout_of_the_same_weights_gives_the_same_output(layouts):
    engines = {name: MTPEngine.load(path) for name, path in layouts.items()}
    first = next(iter(engines.values()))
    params = dict(tree_flatten(first.model.parameters())) | {
        f"mtp.{k}": v for k, v in tree_flatten(first.checkpoint.head.parameters())}
    outputs = {}
    for name, engine in engines.items():
        other = dict(tree_flatten(engine.model.parameters())) | {
            f"mtp.{k}": v for k, v in tree_flatten(engine.checkpoint.head.parameters())}
        assert other.keys() == params.keys(), name
        assert all(mx.array_equal(other[k], params[k]) for k in params), name
        outputs[name] = [engine.generate(p, max_tokens=32, mode="chain", draft_tokens=3).tokens for p in PROMPTS[:4]]
    assert all(out == outputs["vl fused"] for out in outputs.values())


def test_tie_stated_only_at_the_top_of_a_vl_config(tmp_path, loaded):
    path, engine, _ = loaded("q35_dense_l5_fai5_kv4_tied_linear_rope")
    folder = tmp_path / "tied"
    shutil.copytree(path, folder)
    config = json.loads((folder / "config.json").read_text())
    del config["text_config"]["tie_word_embeddings"]
    (folder / "config.json").write_text(json.dumps(config))
    other = MTPEngine.load(folder)
    assert other.text.args.tie_word_embeddings
    prompt = engine.encode(PROMPTS[0])
    assert other.generate(prompt, max_tokens=24).tokens == engine.generate(prompt, max_tokens=24).tokens


def test_folders_the_engine_cannot_use_are_refused_by_name(tmp_path):
    no_head = make_tiny_checkpoint(tmp_path / "no-head", tiny_qwen35_config(), with_mtp=False)
    with pytest.raises(MissingMTPHeadError, match="no MTP head"):
        MTPEngine.load(no_head)
    dedicated = make_tiny_checkpoint(tmp_path / "dedicated", tiny_qwen35_config(mtp_use_dedicated_embeddings=True))
    with pytest.raises(CheckpointError, match="mtp_use_dedicated_embeddings"):
        MTPEngine.load(dedicated)
    config = json.loads((dedicated / "config.json").read_text())
    config["text_config"].update(mtp_use_dedicated_embeddings=False, mtp_num_hidden_layers=2)
    (dedicated / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="mtp_num_hidden_layers=2 but the checkpoint holds 1"):
        MTPEngine.load(dedicated)


def test_the_runner_takes_a_qwen35_folder_without_flags(tmp_path, loaded, capsys):
    path, engine, _ = loaded("q35_moe_l6_fai3_kv1_e8k3_rope1e6")
    dataset = tmp_path / "in.jsonl"
    dataset.write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n" for i, p in enumerate(PROMPTS[:5])))
    out = tmp_path / "out"
    code = jobs_main(["generate", "--dataset", str(dataset), "--model", str(path), "--output", str(out),
                      "--max-tokens", "16", "--mode", "chain", "--batch-size", "4"])
    assert code == 0, capsys.readouterr().err
    import datasets

    rows = {r["id"]: r for r in datasets.load_from_disk(str(out))}
    for i, prompt in enumerate(PROMPTS[:5]):
        alone = engine.generate(prompt, max_tokens=16)
        assert rows[str(i)]["completion"] == alone.text
        assert rows[str(i)]["completion_tokens"] == len(alone.tokens)

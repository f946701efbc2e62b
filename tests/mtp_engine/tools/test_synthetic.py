"""Random quantized models at real shapes (the benchmarks' 80B stand-in)
run the way a loaded checkpoint runs."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mtp_engine import MTPEngine
from mtp_engine.kernels import cpu_recurrence
from mtp_engine.model.gated_delta import mix_tokens, recurrence_path
from mtp_engine.options import EngineOptions
from mtp_engine.tools.synthetic import (
    qwen3_next_80b_config,
    random_quantized_checkpoint,
)

PROMPT = [12, 7, 99, 31, 5, 150, 42, 8, 77, 3]


def _small_80b_pattern() -> dict:
    """The 80B's layer pattern (3 gated-delta : 1 attention, routed experts
    plus a shared one, grouped key heads) at toy width."""
    return qwen3_next_80b_config(
        hidden_size=64,
        num_hidden_layers=4,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        vocab_size=384,
    )


@pytest.fixture(scope="module")
def synthetic():
    return random_quantized_checkpoint(_small_80b_pattern(), options=EngineOptions(compile_layers=False))


def test_synthetic_models_are_built_for_inference(synthetic):
    # mlx_lm.load leaves models in inference mode; a benchmark model left
    # training would skip the engine's recurrence (and time mlx-lm's ops).
    for module in (synthetic.model, synthetic.head):
        assert all(not m.training for _, m in module.named_modules())
    linear = [layer.linear_attn for layer in synthetic.model.model.layers if layer.is_linear]
    assert len(linear) == 3
    if cpu_recurrence.availability() is None:
        assert recurrence_path(synthetic.model) == "cpu primitive"


@pytest.mark.skipif(cpu_recurrence.availability() is not None, reason="needs the CPU recurrence primitive")
def test_a_model_left_training_takes_mlx_lm_ops(synthetic, monkeypatch):
    calls = []
    real = cpu_recurrence.gated_delta_tokens
    monkeypatch.setattr(cpu_recurrence, "gated_delta_tokens", lambda *a: (calls.append(1), real(*a))[1])
    layer = [l.linear_attn for l in synthetic.model.model.layers if l.is_linear][0]
    x = mx.zeros((1, 2, synthetic.model.args.hidden_size))
    conv = mx.zeros((1, layer.conv_kernel_size - 1, layer.conv_dim))
    mix_tokens(layer, x, conv, None)  # inference mode: the primitive
    try:
        synthetic.model.train()
        mix_tokens(layer, x, conv, None)  # training: mlx-lm's ops, whatever was installed
    finally:
        synthetic.model.eval()
    assert calls == [1]


def test_synthetic_speculative_decoding_equals_plain_decoding(synthetic):
    engine = MTPEngine(synthetic)
    plain = engine.generate(PROMPT, max_tokens=24, mode="baseline").tokens
    for mode in ("chain", "tree"):
        assert engine.generate(PROMPT, max_tokens=24, mode=mode, draft_tokens=3).tokens == plain, mode


def test_engine_puts_its_models_in_inference_mode():
    checkpoint = random_quantized_checkpoint(_small_80b_pattern(), options=EngineOptions(compile_layers=False), seed=1)
    checkpoint.model.train()
    checkpoint.head.train()
    MTPEngine(checkpoint)
    for module in (checkpoint.model, checkpoint.head):
        assert all(not m.training for _, m in module.named_modules())
    assert recurrence_path(checkpoint.model) != "mlx-lm ops" or cpu_recurrence.availability() is not None


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3.5-27b-pattern", "qwen3.5-35b-a3b-pattern"])
def test_qwen35_synthetic_models_decode_losslessly_with_projected_drafts(moe):
    """The Qwen3.5 builders' structure at toy width: mlx-lm's qwen3_5 classes,
    quantized, capturing layers installed; drafts projected at a profile
    leave the output equal to plain decoding."""
    from mtp_engine.model.gated_delta import CapturingQwen35GatedDeltaNet
    from mtp_engine.tools.dataset_bench import decode_prompts
    from mtp_engine.tools.projection import ProjectedDrafts, parse_profile
    from mtp_engine.tools.synthetic import qwen3_5_27b_config, qwen3_5_35b_a3b_config

    toy = dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, linear_num_value_heads=4, linear_num_key_heads=2,
               linear_key_head_dim=32, linear_value_head_dim=32, vocab_size=384)
    if moe:
        toy.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64)
    config = (qwen3_5_35b_a3b_config if moe else qwen3_5_27b_config)(**toy)
    assert config["text_config"]["linear_num_value_heads"] == 4 and ("num_experts" in config["text_config"]) == moe
    engine = MTPEngine(random_quantized_checkpoint(config, options=EngineOptions(compile_layers=False)))
    linear = [layer.linear_attn for layer in engine.model.layers if layer.is_linear]
    assert len(linear) == 3 and all(isinstance(a, CapturingQwen35GatedDeltaNet) for a in linear)
    assert engine.checkpoint.head.fc.bits == 4
    plain = engine.generate(PROMPT, max_tokens=24, mode="baseline").tokens
    projection = ProjectedDrafts(parse_profile("0.93,0.82,0.64"), plain, vocab=384, seed=0)
    result = decode_prompts(engine, [engine.encode(PROMPT)], 24, 1, 3, [projection])[0][0]
    assert result.tokens == plain and result.stats.accepted > 0

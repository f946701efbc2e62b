"""Random quantized models at real shapes (the benchmarks' 80B stand-in)
run the way a loaded checkpoint runs."""

from __future__ import annotations

import pytest

from mtp_engine import MTPEngine, cpu_recurrence
from mtp_engine.recurrent import recurrence_path
from mtp_engine.synthetic import qwen3_next_80b_config, random_quantized_checkpoint

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
    return random_quantized_checkpoint(_small_80b_pattern(), compile_layers=False)


def test_synthetic_models_are_built_for_inference(synthetic):
    # mlx_lm.load leaves models in inference mode; a benchmark model left
    # training would skip the engine's recurrence (and time mlx-lm's ops).
    for module in (synthetic.model, synthetic.head):
        assert all(not m.training for _, m in module.named_modules())
    linear = [layer.linear_attn for layer in synthetic.model.model.layers if layer.is_linear]
    assert len(linear) == 3
    if cpu_recurrence.extension() is not None:
        assert all(cpu_recurrence.serves(layer) for layer in linear)
        assert recurrence_path(synthetic.model) == "cpu primitive"


def test_recurrence_path_names_a_model_left_training(synthetic):
    try:
        synthetic.model.train()
        assert recurrence_path(synthetic.model) == "mlx-lm ops"
    finally:
        synthetic.model.eval()


def test_synthetic_speculative_decoding_equals_plain_decoding(synthetic):
    engine = MTPEngine(synthetic)
    plain = engine.generate(PROMPT, max_tokens=24, mode="baseline").tokens
    for mode in ("chain", "tree"):
        assert engine.generate(PROMPT, max_tokens=24, mode=mode, draft_tokens=3).tokens == plain, mode


def test_engine_puts_its_models_in_inference_mode():
    checkpoint = random_quantized_checkpoint(_small_80b_pattern(), compile_layers=False, seed=1)
    checkpoint.model.train()
    checkpoint.head.train()
    MTPEngine(checkpoint)
    for module in (checkpoint.model, checkpoint.head):
        assert all(not m.training for _, m in module.named_modules())
    assert recurrence_path(checkpoint.model) != "mlx-lm ops" or cpu_recurrence.extension() is None

"""The benchmark harness runs every mode side by side and reports in the
documented JSON shape (no timing is asserted here)."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from mtp_engine import MTPEngine
from mtp_engine.kernels import cpu_recurrence
from mtp_engine.tools.bench import cost_model, machine_info, main
from mtp_engine.tools.host_cost import host_cost_suite
from mtp_engine.tools.prefill_cost import prefill_cost_suite


def test_bench_report(tmp_path, tiny_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def add(a, b):", "Hello", "class A:"]))
    out = tmp_path / "bench.json"
    code = main(["--model", str(tiny_path), "--prompts", str(prompts), "--limit", "2", "--max-tokens", "8",
                 "--rounds", "1", "--batch-sizes", "1", "2", "--json", str(out),
                 "--modes", "baseline", "mlx_lm", "chain-k3", "tree-k3", "paths-k3-p2"])
    assert code == 0
    report = json.loads(out.read_text())
    assert {"results", "machine", "cost_model", "dataset_throughput"} <= report.keys()
    by_mode = {r["mode"]: r for r in report["results"]}
    assert set(by_mode) == {"baseline", "mlx_lm", "chain-k3", "tree-k3", "paths-k3-p2"}
    for r in report["results"]:
        assert {"mode", "params", "tokens_per_s", "speedup", "acceptance_length", "identical"} <= r.keys()
        assert r["identical"] is True
    assert by_mode["baseline"]["speedup"] == 1.0
    assert by_mode["chain-k3"]["acceptance_length"] >= 1.0
    assert set(report["cost_model"]["forward_ratio"]) >= {"1", "2", "4"}
    assert {b["mode"] for b in report["dataset_throughput"]} >= {"batch-b1", "batch-b2", "batch-b2-chain-k3",
                                                                 "batch-b2-auto-k3"}  # what jobs decode with
    assert report["compiled_layers"] is True  # the CPU default
    assert report["rowwise_linears"] is False  # row-by-row products are a GPU default
    # Which code ran the recurrence is part of the report (float32 on the CPU:
    # the primitive where `make install` built it, else mlx-lm's ops).
    assert report["recurrence"] == ("cpu primitive" if cpu_recurrence.availability() is None else "mlx-lm ops")


def test_machine_record_names_mlx_settings(monkeypatch):
    """MLX's own settings of the process travel with every figure (some,
    as the CUDA graph size, move host time per forward)."""
    monkeypatch.delenv("MLX_MAX_OPS_PER_BUFFER", raising=False)
    assert "MLX_MAX_OPS_PER_BUFFER" not in machine_info().get("mlx_environment", {})
    monkeypatch.setenv("MLX_MAX_OPS_PER_BUFFER", "200")
    monkeypatch.setenv("MLXNOT_A_SETTING", "1")
    settings = machine_info()["mlx_environment"]
    assert settings["MLX_MAX_OPS_PER_BUFFER"] == "200" and "MLXNOT_A_SETTING" not in settings


def test_bench_eager_layers_give_the_same_tokens(tmp_path, tiny_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):"}))
    out = tmp_path / "bench.json"
    code = main(["--model", str(tiny_path), "--prompts", str(prompts), "--limit", "1", "--max-tokens", "8",
                 "--rounds", "1", "--batch-sizes", "--fast-path", "compile_layers=off", "--json", str(out),
                 "--modes", "baseline", "mlx_lm", "chain-k2", "chain-k8"])
    report = json.loads(out.read_text())
    assert code == 0 and report["compiled_layers"] is False
    assert all(r["identical"] for r in report["results"])
    # The cost model times every verify width a timed chain feeds (K + 1).
    assert set(report["cost_model"]["forward_ratio"]) == {str(t) for t in range(1, 10)}


def test_cost_model_prices_a_kernel_chain_as_one_launch():
    """With the CUDA chain kernel a chain of K drafts is priced by its own
    measured cost, not K MTP steps; chains drafted by the MLX head keep
    K MTP steps."""
    costs = {"verify_s": {1: 0.010, 5: 0.012, 9: 0.013}, "mtp_step_s": 0.002, "drafter": "cuda",
             "kernel_chain_s": {4: 0.001, 8: 0.002}}
    rows = [
        dict(mode="chain-k4", params=dict(mode="chain", draft_tokens=4), acceptance_length=3.0,
             decode_speedup=2.0),
        dict(mode="chain-k8-mlxdraft", params=dict(mode="chain", draft_tokens=8, drafter="mlx"),
             acceptance_length=5.0, decode_speedup=2.5),
    ]
    cm = cost_model(costs, rows)
    by_mode = {p["mode"]: p for p in cm["predicted"]}
    assert by_mode["chain-k4"]["predicted_speedup"] == round(3.0 * 0.010 / (0.001 + 0.012), 3)
    assert by_mode["chain-k8-mlxdraft"]["predicted_speedup"] == round(5.0 * 0.010 / (8 * 0.002 + 0.013), 3)
    assert cm["kernel_chain_ratio"] == {"4": 0.1, "8": 0.2}
    assert cm["chain_drafter"] == "cuda"


def test_dataset_suite_times_one_at_a_time_on_the_first_prompts_only(tmp_path, tiny_path):
    # A slow model's dataset run: one-at-a-time decoding on the first 2 of 4
    # prompts, chains at two depths, drafts projected at a profile, batched
    # chains and mode auto (its controller sees the projected drafts); every
    # row still equals the reference (plain decoding, then plain batching).
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def add(a, b):", "Hello", "class A:", "x = "]))
    out = tmp_path / "bench.json"
    code = main(["--model", str(tiny_path), "--prompts", str(prompts), "--suite", "dataset", "--limit", "4",
                 "--max-tokens", "6", "--batch-sizes", "2", "--draft-tokens", "2", "--single-k", "1", "3",
                 "--single-limit", "2", "--acceptance-profile", "0.9,0.5", "--no-mlx-lm-batch",
                 "--json", str(out)])
    assert code == 0
    run = json.loads(out.read_text())  # one context: its report at the top level
    assert run["settings"]["single_sequence_prompts"] == 2
    assert "plain batching at B=2" in run["settings"]["reference"]
    rows = {(r["mode"], r["draft_tokens"]): r for r in run["dataset_runs"]}
    assert set(rows) == {("plain, one at a time", 0), ("single-sequence chain", 1),
                         ("single-sequence chain", 3), ("plain batching", 0), ("batched chain", 2),
                         ("batched auto", 3)}
    assert [(c["draft_tokens"], c["batch_size"]) for c in run["batched_cost_model"]] == [(2, 2)]
    for (mode, _), r in rows.items():
        n = 2 if mode in ("plain, one at a time", "single-sequence chain") else 4
        assert r["prompts"] == n and r["identical"] == f"{n}/{n}"
        if r["draft_tokens"]:
            assert r["projected_at_profile"] == "0.9,0.5"


def test_dataset_suite_interleaves_single_sequence_rounds(tmp_path, tiny_path):
    # --single-rounds 2: plain decoding and the chain are timed again, two
    # rounds interleaved prompt by prompt; each row counts both rounds'
    # tokens, and every round's outputs equal the reference.
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def add(a, b):", "Hello", "class A:"]))
    out = tmp_path / "bench.json"
    code = main(["--model", str(tiny_path), "--prompts", str(prompts), "--suite", "dataset", "--limit", "3",
                 "--max-tokens", "5", "--batch-sizes", "--single-k", "2", "--single-rounds", "2",
                 "--acceptance-profile", "0.9,0.5", "--no-mlx-lm-batch", "--json", str(out)])
    assert code == 0
    run = json.loads(out.read_text())
    assert run["settings"]["single_sequence_rounds"] == "2, interleaved prompt by prompt"
    rows = {(r["mode"], r["draft_tokens"]): r for r in run["dataset_runs"]}
    assert set(rows) == {("plain, one at a time", 0), ("single-sequence chain", 2)}
    for r in rows.values():
        assert r["prompts"] == 3 and r["identical"] == "6/6"
        assert r["tokens"] == 2 * 3 * 5  # both rounds, 5 tokens a prompt (the tiny model never ends early)
    assert rows[("single-sequence chain", 2)]["projected_at_profile"] == "0.9,0.5"


def test_dataset_suite_rotates_batched_rounds(tmp_path, tiny_path, capsys):
    # --batch-rounds 3: plain batching and the chains K=1, 2 run three times,
    # each round starting one mode later (the first round's plain batching is
    # the reference run); each row sums its rounds' tokens and compares every
    # round's outputs with the reference.
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def add(a, b):", "Hello", "class A:"]))
    out = tmp_path / "bench.json"
    code = main(["--model", str(tiny_path), "--prompts", str(prompts), "--suite", "dataset", "--limit", "3",
                 "--max-tokens", "5", "--batch-sizes", "2", "--draft-tokens", "1", "2", "--single-k", "1",
                 "--single-limit", "1", "--batch-rounds", "3", "--acceptance-profile", "0.9,0.5",
                 "--no-mlx-lm-batch", "--auto-k", "--json", str(out)])
    assert code == 0
    run = json.loads(out.read_text())
    assert run["settings"]["batched_rounds"] == "3, each starting one mode later"
    rows = {(r["mode"], r["draft_tokens"]): r for r in run["dataset_runs"] if r["batch_size"] == 2}
    assert set(rows) == {("plain batching", 0), ("batched chain", 1), ("batched chain", 2)}
    for r in rows.values():
        assert r["prompts"] == 3 and r["identical"] == "9/9"
        assert r["tokens"] == 3 * 3 * 5
    order = [line.split(":")[0].strip() for line in capsys.readouterr().out.splitlines()
             if line.strip().startswith("B=2 ") and "round" in line]
    assert order == ["B=2 plain, round 1", "B=2 K=1, round 1", "B=2 K=2, round 1",
                     "B=2 K=1, round 2", "B=2 K=2, round 2", "B=2 plain, round 2",
                     "B=2 K=2, round 3", "B=2 plain, round 3", "B=2 K=1, round 3"]


def test_batch_rounds_must_be_positive(tmp_path, tiny_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--model", str(tiny_path), "--suite", "dataset", "--batch-rounds", "0"])
    assert e.value.code == 2
    assert "--batch-rounds must be 1 or more, got 0" in capsys.readouterr().err


def test_host_cost_suite_splits_each_forward(tmp_path, tiny_path):
    # One decoding step and one verify forward of 3 tokens, each timed in
    # its three host/device phases, with their primitives counted; the
    # verify forward has a commit.
    out = tmp_path / "host.json"
    code = main(["--model", str(tiny_path), "--suite", "host-cost", "--widths", "1", "3", "--context", "64",
                 "--fast-path", "layer_dispatch=off", "--json", str(out)])
    assert code == 0
    run = json.loads(out.read_text())
    assert run["settings"]["layer_dispatch"] is False and run["settings"]["prompt_tokens"] == 64
    plain, verify = run["forwards"]
    assert (plain["width"], verify["width"]) == (1, 3)
    for r in (plain, verify):
        assert min(r["build_ms"], r["async_eval_ms"], r["device_ms"]) >= 0
        assert r["primitives"] == sum(r["primitives_by_type"].values()) > 100
    assert plain["commit_ms"] is None and plain["commit_primitives"] is None
    assert verify["commit_ms"] >= 0 and verify["commit_primitives"] > 0
    # Each kind of decoder layer alone at each width: its layers account
    # for the forward but its ends (embedding, final norm, LM head, choice).
    layers = run["layers"]
    assert layers["gated_delta"] > 0 and layers["attention"] > 0
    for forward, pieces in zip(run["forwards"], run["pieces"]):
        assert pieces["width"] == forward["width"]
        for name in ("gated_delta_layer", "attention_layer", "mlp"):
            assert pieces[name]["primitives"] == sum(pieces[name]["primitives_by_type"].values()) > 0
            assert min(pieces[name]["build_ms"], pieces[name]["async_eval_ms"], pieces[name]["device_ms"]) >= 0
        in_layers = (layers["gated_delta"] * pieces["gated_delta_layer"]["primitives"]
                     + layers["attention"] * pieces["attention_layer"]["primitives"])
        assert 0 < forward["primitives"] - in_layers < 60, (forward["primitives"], in_layers)


def test_host_cost_suite_refuses_bad_widths(tiny_path):
    engine = MTPEngine.load(tiny_path)
    with pytest.raises(ValueError, match=r"widths must be positive ints, got \[1, 0\]"):
        host_cost_suite(engine, [5, 6, 7], [1, 0])


def test_prefill_cost_suite_times_the_prefill_and_its_pieces(tmp_path, tiny_path):
    # One prompt's whole prefill, then each kind of layer, its mixer, the
    # recurrence, projections and the MoE block's parts alone over its
    # length, and the routed experts grouped in blocks of each size.
    out = tmp_path / "prefill.json"
    code = main(["--model", str(tiny_path), "--suite", "prefill-cost", "--block-rows", "4", "16", "--context", "64",
                 "--json", str(out)])
    assert code == 0
    run = json.loads(out.read_text())
    engine = MTPEngine.load(tiny_path)
    linear = sum(layer.is_linear for layer in engine.model.model.layers)
    assert run["settings"]["prompt_tokens"] == 64 and run["settings"]["recurrence"] == "cpu primitive"
    assert run["layers"] == {"gated_delta": linear, "attention": len(engine.model.model.layers) - linear}
    pieces = run["pieces_ms"]
    assert set(pieces) == {"prefill", "gated_delta_layer", "gated_delta_mixer", "gated_delta_projections",
                           "recurrence", "attention_layer", "attention_mixer", "mlp", "router", "shared_expert"}
    assert all(ms > 0 for ms in pieces.values())
    assert set(run["expert_blocks_ms"]) == {"4", "16"} and all(ms > 0 for ms in run["expert_blocks_ms"].values())
    assert run["estimate_ms"] > 0


def test_prefill_cost_suite_refuses_bad_block_rows(tiny_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--model", str(tiny_path), "--suite", "prefill-cost", "--block-rows", "16", "0"])
    assert exit_.value.code == 2 and "--block-rows must be positive, got 16 0" in capsys.readouterr().err
    engine = MTPEngine.load(tiny_path)
    with pytest.raises(ValueError, match=r"block_rows must be positive ints, got \[\]"):
        prefill_cost_suite(engine, [5, 6, 7], [])
    with pytest.raises(ValueError, match="the prompt needs at least 2 tokens, got 1"):
        prefill_cost_suite(engine, [5], [16])


def test_interleaved_rounds_draw_acceptances_of_their_own(tiny_engine):
    # Projected single-sequence chains: each round draws with seeds of its
    # own (one draw over one prompt can sit well off the profile, so rounds
    # average several draws), and the outputs still equal plain decoding.
    from mtp_engine.tools.dataset_bench import run_singles_interleaved

    ids = list(range(3, 40))
    reference = tiny_engine.generate(ids, max_tokens=40, mode="baseline").tokens
    one = run_singles_interleaved(tiny_engine, [ids], 40, [3], [reference], (0.6,), rounds=1)[1]
    four = run_singles_interleaved(tiny_engine, [ids], 40, [3], [reference], (0.6,), rounds=4)[1]
    assert one.tokens == len(reference) >= 20 and four.tokens == 4 * one.tokens
    assert four.steps != 4 * one.steps  # the same draws each round would take exactly four times the steps
    assert one.outputs == four.outputs == [reference]


def test_warm_up_meets_every_verify_shape_of_a_batched_tail(tiny_engine, monkeypatch):
    # A timed batched chain's rows finish at different steps, so its verify
    # forwards meet [rows, K+1] for every bucket of rows from B down (on a
    # GPU finished rows keep their places down to a bucket (`row_buckets`), and each
    # shape costs far more the first time it is met; on the CPU every row
    # count is a bucket). The warm-up meets all of them (plain batching's
    # [rows, 1] and mode auto's every width) before anything is timed, and
    # no other row count.
    from mtp_engine import decoder
    from mtp_engine.tools.dataset_bench import warm_up

    shapes = set()
    verify, plain_step = decoder.verify, decoder.Decoder._plain_step

    def recording(trunk, lm_head, caches, xs, proposal, *args):
        shapes.add((xs.shape[0], 1 + (0 if proposal is None else proposal.tokens.shape[1])))
        return verify(trunk, lm_head, caches, xs, proposal, *args)

    def recording_plain(self):
        shapes.add((len(self.rows), 1))
        return plain_step(self)

    monkeypatch.setattr(decoder, "verify", recording)
    monkeypatch.setattr(decoder.Decoder, "_plain_step", recording_plain)
    prompts = [list(range(3 + i, 20 + 3 * i)) for i in range(3)]
    warm_up(tiny_engine, prompts, [6], [2, 3], [], profile=(0.6,))
    buckets = decoder.Decoder(tiny_engine, decoder.DecodeConfig(batch_size=6)).buckets
    assert buckets == ([6] if mx.default_device() == mx.gpu else [1, 2, 3, 4, 5, 6])
    assert {(rows, width) for rows in buckets for width in (1, 2, 3, 4)} <= shapes, sorted(shapes)
    assert {rows for rows, _ in shapes} == set(buckets)

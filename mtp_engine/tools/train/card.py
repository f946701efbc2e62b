"""Measure the trained model on the held-out prompts and write its model card."""

from __future__ import annotations

import json
import time
from pathlib import Path

import orjson

from mtp_engine import MTPEngine
from mtp_engine.tools.loops import find_loop, loop_start

MEASURED_MODES = (
    [("baseline", {})]
    + [(f"chain K={k}", dict(mode="chain", draft_tokens=k)) for k in range(1, 6)]
    + [
        ("adaptive K=5 tau=0.5", dict(mode="adaptive", draft_tokens=5, tau=0.5)),
        ("tree K=3", dict(mode="tree", draft_tokens=3)),
        ("adaptive_tree K=5 tau=0.5", dict(mode="adaptive_tree", draft_tokens=5, tau=0.5)),
        ("paths K=3 P=3", dict(mode="paths", draft_tokens=3, paths=3)),
    ]
)


def read_prompts(path: Path, limit: int | None) -> list[dict]:
    rows = [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
    return rows[:limit] if limit else rows


def measure(engine: MTPEngine, prompts: list[dict], max_tokens: int) -> dict:
    """Acceptance of every mode, identity with baseline, and the loop rate."""
    baseline = {}
    results = {}
    for name, kwargs in MEASURED_MODES:
        steps = accepted = tokens = identical = 0
        clean_steps = clean_accepted = 0
        started = time.perf_counter()
        for row in prompts:
            r = engine.generate(row["prompt"], max_tokens=max_tokens, trace=name != "baseline", **kwargs)
            tokens += len(r.tokens)
            if name == "baseline":
                baseline[row["id"]] = r.tokens
                continue
            identical += r.tokens == baseline[row["id"]]
            steps += r.stats.steps
            accepted += r.stats.accepted
            # Steps that end before the output's final loop begins.
            end, cut = 1, loop_start(r.tokens)
            for step in r.trace:
                end += len(step.emitted)
                if end > cut:
                    break
                clean_steps += 1
                clean_accepted += step.accepted
        entry = {"tokens": tokens, "seconds": round(time.perf_counter() - started, 2)}
        if name != "baseline":
            entry.update(
                acceptance_length=round((accepted + steps) / steps, 3),
                acceptance_length_before_loops=(
                    round((clean_accepted + clean_steps) / clean_steps, 3) if clean_steps else None
                ),
                identical_to_baseline=f"{identical}/{len(prompts)}",
            )
        results[name] = entry
    starts = [loop_start(t) / max(len(t), 1) for t in baseline.values()]
    results["loops"] = {
        "prompts_ending_in_a_loop": sum(find_loop(t) is not None for t in baseline.values()),
        "prompts": len(prompts),
        "mean_fraction_before_loop": round(sum(starts) / len(starts), 3),
    }
    return results


def measure_and_write_card(model: Path, prompts_path: Path, max_tokens: int = 128, limit: int | None = None) -> dict:
    engine = MTPEngine.load(model, dtype="float32")
    prompts = read_prompts(prompts_path, limit)
    results = measure(engine, prompts, max_tokens)
    (model / "acceptance.json").write_text(json.dumps(
        {"max_tokens": max_tokens, "prompts": len(prompts), "dtype": "float32", "results": results}, indent=2
    ))
    write_card(model)
    print(json.dumps(results, indent=2))
    return results


def distillation_lines(runs: list[dict]) -> list[str]:
    """Model-card lines for the head's self-distillation runs (`mtp_engine.train.distill`)."""
    if not runs:
        return []
    first, last = runs[0]["history"][0], runs[-1]["history"][-1]
    depths = sorted(int(k[5:]) for k in first if k.startswith("agree"))
    lines = [
        "## MTP head self-distillation",
        "",
        "After `fit`, the head alone was retrained on the trunk's own predictions "
        "(`python -m mtp_engine.train distill`): at every draft depth it learns the trunk's argmax "
        "(and, with hard_weight < 1, its softmax), on corpus windows and on the trunk's own greedy "
        "continuations of corpus prefixes. The trunk, embedding and LM head are unchanged, so "
        "greedy output is the same as before.",
        "",
        "| run | steps | tokens | seconds | hard weight | depth weights | generated fraction |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for i, r in enumerate(runs, 1):
        st = r["settings"]
        lines.append(f"| {i} | {r['steps_done']} | {r['tokens_seen']} | {r['seconds']} | {st['hard_weight']} | "
                     f"{', '.join(str(w) for w in st['depth_weights'])} | {st['generated_fraction']} |")
    lines += [
        "",
        "Reproduce (each run starts from the previous run's output; the runs trained about "
        "30,000 tokens a second on an H200, a 2-core CPU manages about 100, too slow for this): `python -m mtp_engine.train distill --model M --out M --batch-size "
        f"{runs[-1]['settings']['batch_size']} --hard-weight {runs[-1]['settings']['hard_weight']} "
        "--max-seconds S`.",
        "",
        "Held-out agreement with the trunk's argmax under teacher forcing (depth j: the head's "
        "j-th chained draft given the true earlier tokens), before the first run and after the last:",
        "",
        "| depth | " + " | ".join(str(d) for d in depths) + " |",
        "| --- | " + " | ".join("---" for _ in depths) + " |",
        "| head as fit | " + " | ".join(f"{first[f'agree{d}']:.3f}" for d in depths) + " |",
        "| distilled | " + " | ".join(f"{last[f'agree{d}']:.3f}" for d in depths) + " |",
        "",
    ]
    return lines


def write_card(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    training = json.loads((model / "training.json").read_text()) if (model / "training.json").exists() else {}
    acceptance = json.loads((model / "acceptance.json").read_text()) if (model / "acceptance.json").exists() else {}
    last = (training.get("history") or [{}])[-1]
    corpus = training.get("corpus", {})
    settings = training.get("settings", {})
    lines = [
        "---",
        "license: apache-2.0",
        "library_name: mlx",
        "tags: [qwen3_next, mtp, speculative-decoding, tiny]",
        "---",
        "",
        "# qwen3-next-tiny-stdlib",
        "",
        "A small Qwen3-Next-architecture model (gated DeltaNet and gated attention 3:1, MoE with a "
        "shared expert) with a trained multi-token-prediction (MTP) head, in the Hugging Face Hub "
        "layout (`mtp.*` tensors included). Made to exercise and benchmark lossless MTP speculative "
        "decoding on MLX; it writes Python-like code and nothing else of use.",
        "",
        "## Shape",
        "",
        f"- hidden {config['hidden_size']}, {config['num_hidden_layers']} layers "
        f"(every {config['full_attention_interval']}th full attention), vocab {config['vocab_size']}",
        f"- {config['num_experts']} experts top-{config['num_experts_per_tok']} "
        f"(intermediate {config['moe_intermediate_size']}) + shared expert "
        f"({config['shared_expert_intermediate_size']}), MTP layers: {config.get('mtp_num_hidden_layers', 1)}",
        f"- weights stored in {config.get('torch_dtype')}",
        "",
        "## Training",
        "",
        f"- Data: the Python {corpus.get('python', '?')} standard library sources (PSF licence), "
        f"{corpus.get('train_files', '?')} files, {corpus.get('train_tokens', '?')} tokens; held out: "
        f"{', '.join(corpus.get('held_out_modules', []))} (and their test files), never trained on.",
        f"- Tokenizer: byte-level BPE with {corpus.get('vocab_size', '?')} tokens trained on the training files.",
        "- From scratch, jointly: trunk LM loss + MTP loss on the trunk's final-normed hidden "
        "(gradient stopped), step 1 (H_i, t_i+1) -> t_i+2 and chained step 2 (M_i, t_i+2) -> t_i+3.",
        f"- {training.get('steps_done', '?')} steps of {settings.get('batch_size', '?')} x "
        f"{settings.get('seq_len', '?')} tokens ({training.get('tokens_seen', '?')} tokens), AdamW, "
        f"peak lr {settings.get('lr', '?')}, on {training.get('device', '?')} in {training.get('seconds', '?')} s.",
        "- Reproduce: `python -m mtp_engine.train prepare && python -m mtp_engine.train fit` "
        "(seeded; see the README).",
        "",
        "## Held-out metrics",
        "",
        f"- trunk perplexity: {last.get('perplexity', float('nan')):.2f}",
        f"- trunk next-token accuracy: {last.get('next_acc', float('nan')):.3f}",
        f"- MTP next-next-token accuracy (step 1): {last.get('mtp1_acc', float('nan')):.3f}",
        f"- MTP chained step 2 accuracy: {last.get('mtp2_acc', float('nan')):.3f}",
        "",
    ]
    lines += distillation_lines(training.get("head_distillation") or [])
    earlier = model / "acceptance-fit-head.json"
    before = json.loads(earlier.read_text())["results"] if earlier.exists() else {}
    if acceptance:
        res = acceptance["results"]
        lines += [
            "## Measured acceptance",
            "",
            f"Greedy decoding of {acceptance['prompts']} held-out prompts (`examples/prompts.jsonl`), "
            f"{acceptance['max_tokens']} tokens each, {acceptance.get('dtype')} on MLX's CPU backend. "
            "Acceptance length = tokens emitted per verify step.",
            "",
            "| mode | acceptance length | before loops | identical to baseline |"
            + (" head as fit: acceptance length | before loops |" if before else ""),
            "| --- | --- | --- | --- |" + (" --- | --- |" if before else ""),
        ]
        for name, r in res.items():
            if name in ("baseline", "loops"):
                continue
            row = (f"| {name} | {r['acceptance_length']:.2f} | {r['acceptance_length_before_loops']} | "
                   f"{r['identical_to_baseline']} |")
            if before:
                b = before.get(name, {})
                row += f" {b.get('acceptance_length', '-')} | {b.get('acceptance_length_before_loops', '-')} |"
            lines.append(row)
        loops = res["loops"]
        lines += [
            "",
            f"{loops['prompts_ending_in_a_loop']} of {loops['prompts']} greedy outputs end in a "
            "repeating loop (the last 24+ tokens periodic with period <= 24); on average the loop "
            f"starts after {100 * loops['mean_fraction_before_loop']:.0f}% of the output. Loops "
            "inflate acceptance, so 'before loops' (only verify steps that end before the "
            "output's final loop begins) is the honest figure.",
            "",
        ]
    (model / "README.md").write_text("\n".join(lines))

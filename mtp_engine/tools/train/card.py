"""Measure the shipped model on the held-out prompts and write its model card.

`measure` reports what the issue tracker and users ask of the model: held-out
perplexity, the loop rate and empty completions of 128-token greedy
completions, and acceptance length at K = 1..4 (all steps, and loop-free:
only verify steps that end before the output's final loop begins) for greedy
decoding and for the exact sampler at T = 0.7 and 1.0, each with how many
outputs equal plain decoding. The card (`write_card`) is built from
``acceptance.json`` and ``training.json`` alone, so it can be rewritten
without measuring again.
"""

from __future__ import annotations

import ast
import json
import math
import time
from pathlib import Path

import orjson

from mtp_engine.tools.loops import MAX_PERIOD, SPAN, find_loop, loop_start

DEPTHS = (1, 2, 3, 4)
SAMPLERS = (("greedy", {}), ("exact T=0.7", {"temperature": 0.7}), ("exact T=1.0", {"temperature": 1.0}))


def read_prompts(path: Path, limit: int | None) -> list[dict]:
    rows = [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
    return rows[:limit] if limit else rows


def perplexity(model_path: Path, tokens, window: int = 256) -> dict:
    """Held-out perplexity over non-overlapping ``window``-token windows."""
    import mlx.core as mx
    import mlx.nn as nn

    from mtp_engine.model.loader import load_checkpoint
    from mtp_engine.options import EngineOptions

    model = load_checkpoint(model_path, dtype="float32", options=EngineOptions(compile_layers=False)).model
    span = window + 1
    n = (len(tokens) - 1) // span
    total = 0.0
    for i in range(0, n, 16):
        x = mx.array(tokens[i * span : min(n, i + 16) * span].reshape(-1, span).astype("int32"))
        loss = nn.losses.cross_entropy(model(x[:, :-1]), x[:, 1:], reduction="sum")
        total += loss.item()
    return {"window": window, "tokens": n * window, "value": round(math.exp(total / (n * window)), 3)}


def step_acceptance(result) -> tuple[int, int, int, int]:
    """(steps, accepted, loop-free steps, loop-free accepted) of a traced result."""
    cut, end, clean_steps, clean_accepted = loop_start(result.tokens), 1, 0, 0
    for step in result.trace:
        end += len(step.emitted)
        if end > cut:
            break
        clean_steps += 1
        clean_accepted += step.accepted
    return result.stats.steps, result.stats.accepted, clean_steps, clean_accepted


def measure(engine, prompts: list[dict], max_tokens: int, acceptance_limit: int, log=print) -> dict:
    """Greedy completions of every prompt (loops, empties, samples), then
    acceptance of chains at each depth and sampler on the first
    ``acceptance_limit`` prompts against plain decoding of the same seed."""
    started = time.perf_counter()
    greedy = [engine.generate(row["prompt"], max_tokens=max_tokens, mode="baseline") for row in prompts]
    seconds = time.perf_counter() - started
    loops = [find_loop(r.tokens) is not None for r in greedy]
    empty = [i for i, r in enumerate(greedy) if not r.tokens]
    log(f"greedy: {sum(loops)}/{len(prompts)} loops, {len(empty)} empty, "
        f"{sum(len(r.tokens) for r in greedy) / seconds:.1f} tok/s")
    out = {
        "prompts": len(prompts),
        "greedy": {
            "loops": sum(loops),
            "loop_rate": round(sum(loops) / len(prompts), 3),
            "empty": len(empty),
            "empty_with_empty_reference": sum(not prompts[i].get("reference", "x").strip() for i in empty),
            "plain_tokens_per_second": round(sum(len(r.tokens) for r in greedy) / seconds, 1),
        },
        "completions": [{"id": row["id"], "prompt": row["prompt"], "completion": r.text, "loop": lp}
                        for row, r, lp in zip(prompts, greedy, loops)],
        "acceptance": {},
        "acceptance_prompts": min(acceptance_limit, len(prompts)),
    }
    rows = prompts[:acceptance_limit]
    for name, sampling in SAMPLERS:
        seeds = [{"seed": i} if sampling else {} for i in range(len(rows))]
        plain = ([r.tokens for r in greedy[: len(rows)]] if not sampling else
                 [engine.generate(row["prompt"], max_tokens=max_tokens, mode="baseline", **sampling, **s).tokens
                  for row, s in zip(rows, seeds)])
        by_depth = {}
        for k in DEPTHS:
            sums = [0, 0, 0, 0]
            identical = 0
            for row, s, reference in zip(rows, seeds, plain):
                r = engine.generate(row["prompt"], max_tokens=max_tokens, mode="chain", draft_tokens=k, trace=True,
                                    **sampling, **s)
                identical += r.tokens == reference
                sums = [a + b for a, b in zip(sums, step_acceptance(r))]
            steps, accepted, clean_steps, clean_accepted = sums
            by_depth[str(k)] = {
                "acceptance_length": round((steps + accepted) / steps, 3) if steps else None,
                "loop_free": round((clean_steps + clean_accepted) / clean_steps, 3) if clean_steps else None,
                "identical_to_plain": f"{identical}/{len(rows)}",
            }
            log(f"{name} K={k}: {by_depth[str(k)]}")
        out["acceptance"][name] = by_depth
    return out


def measure_and_write_card(model: Path, prompts_path: Path, max_tokens: int = 128, limit: int | None = None,
                           data: Path | None = None, acceptance_limit: int = 96) -> dict:
    import numpy as np

    from mtp_engine import MTPEngine

    engine = MTPEngine.load(model, dtype="float32")
    prompts = read_prompts(prompts_path, limit)
    results = measure(engine, prompts, max_tokens, acceptance_limit)
    held = Path(data or ".train-data") / "heldout.npy"
    if held.exists():
        results["perplexity"] = perplexity(model, np.load(held))
    results.update(max_tokens=max_tokens, dtype="float32", measured=time.strftime("%Y-%m-%d"))
    (model / "acceptance.json").write_text(json.dumps(results, indent=1))
    write_card(model)
    return results


def representative(completions: list[dict]) -> list[tuple[str, dict]]:
    """Three completions for the card: a plausible one (no loop, no line
    more than twice, parses as Python with its prompt; the one with the most
    distinct lines), a loop-free one of median length, and the first that
    ends in a loop."""

    parses = _parses_whole

    def lines(c):
        return [line.strip() for line in c["completion"].splitlines() if line.strip()]

    clean = [c for c in completions if not c["loop"] and c["completion"].strip()]
    picks = []
    plausible = [c for c in clean if parses(c) and all(lines(c).count(x) <= 2 for x in lines(c))]
    if plausible:
        picks.append(("plausible: no loop, parses as Python", max(plausible, key=lambda c: len(set(lines(c))))))
    rest = sorted((c for c in clean if all(c is not p for _, p in picks)), key=lambda c: len(c["completion"]))
    if rest:
        picks.append(("loop-free, median length", rest[len(rest) // 2]))
    looping = [c for c in completions if c["loop"]]
    if looping:
        picks.append(("ends in a loop", looping[0]))
    return picks


def _parses_whole(c: dict) -> bool:
    try:
        ast.parse(c["prompt"] + c["completion"])
        return True
    except SyntaxError:
        return False


def _parses_in_part(c: dict) -> bool:
    """Whether the prompt and the completion's first n >= 3 lines parse, for some n."""
    lines = c["completion"].split("\n")
    return any(_parses_whole({"prompt": c["prompt"], "completion": "\n".join(lines[:n])})
               for n in range(len(lines), 2, -1))


def _shown(text: str, most: int = 24) -> str:
    """The first ``most`` lines of a completion (the card notes a cut)."""
    lines = text.rstrip().splitlines()
    return "\n".join(lines[:most] + (["# ... (cut here for the card)"] if len(lines) > most else []))


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)


def write_card(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    training = json.loads((model / "training.json").read_text()) if (model / "training.json").exists() else {}
    measured = json.loads((model / "acceptance.json").read_text()) if (model / "acceptance.json").exists() else {}
    corpus = training.get("corpus", {})
    size = sum(p.stat().st_size for p in model.glob("*.safetensors")) / 1e6
    params = training.get("parameters")
    lines = [
        "---",
        "license: apache-2.0",
        "library_name: mlx",
        "tags: [qwen3_next, mtp, speculative-decoding, tiny]",
        "---",
        "",
        "# qwen3-next-tiny-stdlib",
        "",
        "A small Qwen3-Next-architecture model (gated DeltaNet and gated attention 3:1, MoE with a shared "
        "expert) with a trained multi-token-prediction (MTP) head, in the Hugging Face Hub layout (`mtp.*` "
        "tensors included). It completes Python functions; it exists to show and measure lossless MTP "
        "speculative decoding on a real model.",
        "",
        "## Shape",
        "",
        f"- hidden {config['hidden_size']}, {config['num_hidden_layers']} layers (every "
        f"{config['full_attention_interval']}th full attention), {config['num_attention_heads']} attention heads "
        f"({config['num_key_value_heads']} KV), vocabulary {config['vocab_size']}"
        + (f", {params / 1e6:.1f}M parameters" if params else ""),
        f"- {config['num_experts']} experts top-{config['num_experts_per_tok']} (intermediate "
        f"{config['moe_intermediate_size']}) + a shared expert ({config['shared_expert_intermediate_size']}); "
        f"MTP layers: {config.get('mtp_num_hidden_layers', 1)}",
        f"- weights in {config.get('torch_dtype')}, {size:.1f} MB",
        "",
    ]
    lines += _corpus_lines(corpus)
    lines += _training_lines(training)
    lines += _measured_lines(measured)
    (model / "README.md").write_text("\n".join(lines) + "\n")


def _corpus_lines(corpus: dict) -> list[str]:
    if not corpus:
        return []
    dropped = corpus.get("dropped_files", {})
    lines = [
        "## Data",
        "",
        f"The Python {corpus.get('python')} standard library plus the Python sources of every package the "
        f"project installs (`pip install mtp-batch[cpu]`: its dependencies and theirs), "
        f"{corpus.get('train_files')} files, {corpus.get('train_tokens')} tokens. Exact duplicates "
        f"({dropped.get('duplicate', 0)} files) and near duplicates ({dropped.get('near duplicate', 0)}: most of "
        "their long lines already kept, such as forks of standard modules and model files copied between "
        f"packages) were dropped. Held out, never trained on: {', '.join(corpus.get('held_out_modules', []))}, "
        f"their tests, and every copy of them ({dropped.get('held-out copy', 0)} files: a held-out module's "
        "name, or most long lines from one). Tokenizer: byte-level BPE with "
        f"{corpus.get('vocab_size')} tokens trained on the training files.",
        "",
        "| source | version | licence | files |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {s['name']} | {s['version']} | {s['license']} | {s['files']} |"
              for s in corpus.get("sources", []) if s["files"]]
    return lines + [""]


def _training_lines(training: dict) -> list[str]:
    runs = training.get("scaling", {})
    if not runs:
        return []
    lines = [
        "## Training",
        "",
        "Trained from scratch in PyTorch on one H200 (`python -m mtp_engine.train fit`), trunk and MTP head "
        "jointly: the trunk's next-token loss, plus the head's losses on the trunk's final-normed hidden with "
        "gradients stopped (step 1 `(H_i, t_i+1) -> t_i+2`, chained step 2 `(M_i, t_i+2) -> t_i+3`), which "
        "reach neither the trunk nor the shared embedding and LM head. 512-token windows, 64 a step, AdamW "
        "(betas 0.9/0.95, weight decay 0.1), peak learning rate 2e-3 with a cosine schedule on training time. "
        "Then the head alone was self-distilled (`python -m mtp_engine.train distill`): at each draft depth "
        "1..4 it learns the trunk's distribution and argmax (half each) on corpus prefixes continued by the "
        "trunk itself, greedily and sampled at T = 0.7 and 1.0 (regenerated every 300 steps), and on corpus "
        "windows (a quarter); the trunk is unchanged.",
        "",
        "Scaling tried (three sizes trained at once on the GPU; the small and medium ones for a shorter "
        "time budget; held-out perplexity over 512-token windows):",
        "",
        "| run | hidden | parameters | steps | tokens | seconds | held-out perplexity | head depth-1 agreement with the trunk |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in runs.items():
        last = r["history"][-1]
        lines.append(f"| {name} | {r['config']['hidden_size']} | {r.get('parameters', 0) / 1e6:.1f}M | {r['step']} | "
                     f"{r['tokens']} | {r['seconds']} | {last['perplexity']} | {last['head1_trunk_acc']} |")
    curve = runs.get("fit-large", {}).get("history", [])
    if curve:
        lines += ["", "The large run's held-out perplexity by step: "
                  + ", ".join(f"{h['step']}: {h['perplexity']}" for h in curve) + "."]
    lines += _tune_lines(training, runs)
    lines += [
        "",
        "### Reproduce, and training that survives a lost machine",
        "",
        "```bash",
        "python -m mtp_engine.train prepare                 # corpus -> .train-data/ (tokenizer, train.npy, heldout.npy)",
        "python -m mtp_engine.train fit --preset large --max-seconds 840 --detach   # new session, logs to .train-runs/fit/train.log",
        "python -m mtp_engine.train portable .train-runs/fit /tmp/move              # bfloat16 copy of the newest step (files <= 16 MB)",
        "python -m mtp_engine.train fit --resume .train-runs/fit ...                # continue (a run folder, step folder or portable copy)",
        "python -m mtp_engine.train distill --source .train-runs/fit --max-seconds 420 --detach",
        "python -m mtp_engine.train fit --resume .train-runs/distill --out .train-runs/tune --unlikelihood 1.0 --lr 5e-4 \\",
        "    --min-lr 5e-5 --warmup 50 --max-seconds 300 --detach   # tune the trunk out of its greedy loops",
        "python -m mtp_engine.train export --checkpoint .train-runs/tune --out models/qwen3-next-tiny-stdlib",
        "python -m mtp_engine.train measure                 # acceptance.json and this card",
        "```",
        "",
        "`fit` and `distill` write a checkpoint every 3 minutes (`--checkpoint-minutes`) and at the end: a step "
        "folder of float32 weights and AdamW's moments in files of at most 16 MB, written under a temporary "
        "name, renamed, then named in `latest`, so a kill at any moment leaves the previous step whole. The "
        "batches are a function of the seed and the step, so a run resumed with its optimizer state continues "
        "exactly as the uninterrupted run would have (tested). On the H200, `bash "
        "mtp_engine/tools/train/h200.sh start RUNS ...` runs the scaling fits, picks the best and distills it "
        "in a detached session; `poll RUNS SECONDS` (one device call each, back to back) brings back the logs "
        "and a portable copy of the run in progress, and `resume RUNS PORTABLE fit|distill` continues on a "
        "fresh machine from such a copy, so a lost machine costs only the minutes since the last poll (a "
        "portable copy restarts AdamW's moments with a short warm-up).",
        "",
    ]
    return lines


def _tune_lines(training: dict, runs: dict) -> list[str]:
    """The loop tune (``fit --unlikelihood``), when it made the model."""
    s = training.get("settings", {})
    if training.get("kind") != "fit" or not s.get("unlikelihood") or not training.get("history"):
        return []
    history = training["history"]
    before = runs.get("fit-large", {}).get("history", [{}])[-1].get("perplexity")
    rates = ", ".join(f"{h['step']}: {h['pool_loop_rate']:.1%}" for h in history if "pool_loop_rate" in h)
    return [
        "",
        f"Then trunk and head were tuned out of the trunk's greedy loops (`python -m mtp_engine.train fit --resume "
        f"... --unlikelihood {s['unlikelihood']}`, on one {training.get('device', '?')}): {training['step']} steps, "
        f"{training['seconds']} s, learning rate {s['lr']} falling to {s['min_lr']}. The next-token and head losses on "
        "corpus windows go on, plus sequence-level unlikelihood (Welleck et al. 2020) on the trunk's own greedy "
        f"continuations ({s['new_tokens']} tokens) of {s['pool_sequences']} corpus prefixes, regenerated every "
        f"{s['regenerate_every']} steps: each token that repeats a cycle of period <= 12 inside a stretch of >= 24 "
        "tokens, from the cycle's third pass on, adds -log(1 - p) for its probability p. Share of those "
        f"continuations ending in a loop by step: {rates}; held-out perplexity {before} before the tune, "
        f"{history[-1]['perplexity']} after (512-token windows). The head was not distilled again."
        + ("" if training.get("status") == "done" else
           f" The weights are the run's checkpoint at step {training['step']}: its machine was lost before the end."),
    ]


def _measured_lines(m: dict) -> list[str]:
    if not m:
        return []
    g = m["greedy"]
    ppl = m.get("perplexity")
    lines = [
        "## Measured",
        "",
        f"`python -m mtp_engine.train measure`, {m['dtype']} on MLX's CPU backend, {m['measured']}: "
        f"{m['prompts']} held-out prompts (`examples/prompts.jsonl`, a function's signature and docstring), "
        f"{m['max_tokens']} new tokens each.",
        "",
    ]
    if ppl:
        lines.append(f"- held-out perplexity: **{ppl['value']}** ({ppl['tokens']} tokens in {ppl['window']}-token windows)")
    lines += [
        f"- loop rate: **{100 * g['loop_rate']:.1f}%** ({g['loops']} of {m['prompts']} greedy completions whose last "
        f"{SPAN} tokens repeat a cycle of period <= {MAX_PERIOD})",
        f"- empty greedy completions: {g['empty']} ({g['empty_with_empty_reference']} with an empty reference body)",
        f"- plain greedy decoding: {g['plain_tokens_per_second']} tokens/s, one prompt at a time, 2-core CPU",
        "",
        f"Acceptance length (tokens emitted per verify step) of chain drafting at depth K over the first "
        f"{m['acceptance_prompts']} prompts: all steps / loop-free (only steps that end before the output's final "
        "loop begins; loops are where a head is always right). The exact sampler draws the same tokens as plain "
        "sampling with the seed; 'identical' counts outputs equal to plain decoding.",
        "",
        "| decoding | " + " | ".join(f"K={k}" for k in DEPTHS) + " | identical |",
        "| --- | " + " | ".join("---" for _ in DEPTHS) + " | --- |",
    ]
    for name, by in m["acceptance"].items():
        cells = [f"{_fmt(by[str(k)]['acceptance_length'])} / {_fmt(by[str(k)]['loop_free'])}" for k in DEPTHS]
        same = {by[str(k)]["identical_to_plain"] for k in DEPTHS}
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {', '.join(sorted(same))} |")
    lines += ["", "## Three completions", "",
              "Greedy, as `make generate DATASET=examples/prompts.jsonl` writes them: the prompt's last line, then "
              "the completion (at most 24 lines shown). The model writes Python-shaped text that drifts from the "
              f"docstring. Of the {len(m['completions'])} completions, {sum(map(_parses_whole, m['completions']))} "
              "parse as Python with their prompt as written, "
              f"{sum(map(_parses_in_part, m['completions']))} up to some line at least three lines in (128 tokens "
              f"often stop mid-statement), and {sum(c['loop'] for c in m['completions'])} end in a loop.", ""]
    for label, c in representative(m["completions"]):
        last = c["prompt"].rstrip("\n").splitlines()[-1]
        lines += [f"**{c['id']}** ({label}):", "", "```python", last + _shown(c["completion"]), "```", ""]
    return lines

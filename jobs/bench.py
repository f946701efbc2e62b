"""The job benchmark: what users run, end to end.

``python -m jobs.bench --dataset FILE --model DIR --modes baseline auto ...``
loads the model once and runs the same job (dataset in, shards, ledger and
views out, into a fresh folder each time) once per mode, round and
temperature, alternating the modes so a drifting host falls on each alike. It reports
each run's completion tokens per second over the job's whole wall time
(reading the dataset, prefill, decoding, commits), the ratio to the first
mode's runs, whether every mode wrote the first mode's completions (a
constrained mode: the first mode's of the same constraint), and, for
mode "auto", the depths its controller chose. The model load is not timed
(each job would pay it once).

``--synthetic 80b --acceptance-profile 0.93,0.82,0.64`` runs the job on a
random-weight model of those shapes (`mtp_engine.tools.synthetic`) over
generated prompts of ``--prompt-tokens`` tokens: its costs are real, its
acceptance would be 1.0, so each row's drafts are projected at the profile
(`mtp_engine.tools.projection`, through the runner's ``make_drafter``) onto
the row's tokens from the first mode's first run (plain batching). Every run
then stores token ids (``logprobs=0``) so all pay the same. Such figures are
"projected at profile X", never measured acceptance.
"""

from __future__ import annotations

import argparse
import io
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import datasets
import mlx.core as mx
import numpy as np
import orjson

from jobs.config import JobConfig
from jobs.prefix_data import make_rows
from jobs.runner import run_job
from jobs.status import folder_state
from mtp_engine import MTPEngine
from mtp_engine.constraints import ROW_FIELDS
from mtp_engine.modes import MODES
from mtp_engine.tools.phases import PHASES, PhaseTimer
from mtp_engine.tools.projection import ProjectedDrafts, ProjectingDrafter, parse_later, parse_profile
from mtp_engine.tools.synthetic import SYNTHETIC, random_quantized_checkpoint


def mode_spec(text: str) -> tuple[str, int | None, dict]:
    """``MODE``, ``MODE:K`` (K drafts, or at most K under auto), then any
    ``,SETTING=VALUE`` of the job (``baseline,prefix_sharing=false``)."""
    head, *settings = text.split(",")
    name, _, k = head.partition(":")
    if name not in MODES or (k and not k.isdigit()):
        raise argparse.ArgumentTypeError(f"a mode is one of {', '.join(MODES)}, optionally ':K' and ',SETTING=VALUE'; "
                                         f"got {text!r}")
    overrides = {}
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep or key not in JobConfig.__dataclass_fields__:
            raise argparse.ArgumentTypeError(f"{setting!r} in {text!r} is not SETTING=VALUE of a job setting")
        overrides[key] = orjson.loads(value) if value not in ("", "none") else None
    return name, int(k) if k else None, overrides


def _constraint(mode: str) -> dict:
    """The output constraint settings of a ``--modes`` entry: modes that
    differ in them write different rows by design."""
    return {k: v for k, v in mode_spec(mode)[2].items() if k in ROW_FIELDS}


def _argument(parse):
    """``parse`` as an argparse type whose ValueError is the message."""
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return convert


def synthetic_job(name: str, folder: Path, prompts: int, prompt_tokens: int, seed: int = 0,
                  shared_prefix: tuple[int, int, int] | None = None):
    """A random-weight engine of shapes ``name``, a model folder for the job
    to identify it by (its config and tokenizer, no weights) and a JSONL
    dataset of ``prompts`` random texts of about ``prompt_tokens`` tokens, or,
    with ``shared_prefix`` (prefix, shortest and longest suffix, in tokens),
    rows sharing one system prompt (`jobs.prefix_data`)."""
    checkpoint = random_quantized_checkpoint(SYNTHETIC[name]())
    engine = MTPEngine(checkpoint)
    model = folder / f"synthetic-{name}"
    model.mkdir(parents=True)
    (model / "config.json").write_bytes(orjson.dumps(checkpoint.config))
    engine.tokenizer._tokenizer.save_pretrained(str(model))
    dataset = folder / f"synthetic-{prompts}x{prompt_tokens}.jsonl"
    if shared_prefix:
        count = lambda text: len(engine.tokenizer.encode(text))  # noqa: E731
        rows = make_rows(prompts, shared_prefix[0], shared_prefix[1:], seed=seed, count=count)
        dataset.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
        return engine, str(model), str(dataset)
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz     .,;:()=+-_\n0123456789"))
    lines = []
    for i in range(prompts):
        text = "".join(rng.choice(letters, size=prompt_tokens * 3))
        ids = engine.tokenizer.encode(text)[:prompt_tokens]
        lines.append(orjson.dumps({"id": f"p{i:05d}", "prompt": engine.tokenizer.decode(ids)}))
    dataset.write_bytes(b"\n".join(lines) + b"\n")
    return engine, str(model), str(dataset)


def projecting(engine, profile, references: dict, greedy: bool, later=None):
    """The runner's ``make_drafter``: the engine's chain drafter, each row's
    drafts projected at ``profile`` (``later``: another from some new token
    on) onto ``references`` (id -> tokens); row ``i`` of the references
    draws with seed ``i``, the same in every run."""
    vocab = engine.text.args.vocab_size

    def make():
        inner = engine.make_drafter(engine.pick_drafter("chain", greedy=greedy))
        return ProjectingDrafter(inner, {(row_id, 0): ProjectedDrafts(profile, tokens, vocab, seed=i, later=later)
                                         for i, (row_id, tokens) in enumerate(sorted(references.items()))})
    return make


def run_once(engine, dataset: str, model: str, output: Path, mode: str, temperature: float, args,
             references: dict | None = None) -> dict:
    name, k, overrides = mode_spec(mode)
    config = JobConfig(**{**dict(dataset=dataset, model=model, output=str(output), mode=name,
                                 max_tokens=args.max_tokens, batch_size=args.batch_size,
                                 draft_tokens=k or args.draft_tokens, limit=args.limit, temperature=temperature,
                                 seed=args.seed), **({"logprobs": 0} if args.acceptance_profile else {}),
                          **overrides})
    make_drafter = None
    if references is not None and name != "baseline":
        make_drafter = projecting(engine, args.acceptance_profile, references, greedy=temperature == 0,
                                  later=args.profile_after)
    log = io.StringIO()
    # constrained rows' masks: how many, and their host seconds (llguidance is loaded only for constrained modes)
    grammars = engine.grammars if _constraint(mode) else None
    masks_before = (grammars.masks_made, grammars.mask_s) if grammars else (0, 0.0)
    timer = PhaseTimer() if args.phase_times else None
    start = time.perf_counter()
    summary = run_job(config, engine=engine, stream=log, make_drafter=make_drafter, hooks=timer)
    wall = time.perf_counter() - start
    masks = (grammars.masks_made - masks_before[0], grammars.mask_s - masks_before[1]) if grammars else (0, 0.0)
    rows = datasets.load_from_disk(str(output))
    depths = [0] * (config.draft_tokens + 1)
    prefill = sum((a or {}).get("prefill_s") or 0 for a in rows["acceptance"])  # prompts prefill one at a time
    steps = sum((a or {}).get("steps") or 0 for a in rows["acceptance"])
    accepted = sum((a or {}).get("accepted") or 0 for a in rows["acceptance"])
    for a in rows["acceptance"]:
        for d, n in enumerate((a or {}).get("depths") or []):
            depths[d] += n
    lines = log.getvalue().splitlines()
    _, totals, _ = folder_state(output, verify=False)  # the ledgers' figures, as `jobs status` reads them
    return {"mode": mode, "temperature": temperature, "wall_s": round(wall, 3), "tokens": summary.tokens, "rows": summary.committed,
            "tok_s": round(summary.tokens / wall, 1), "decode_tok_s": round(summary.tokens / (wall - prefill), 1),
            "warmup_s": round(totals.warmup_s, 3),
            "controller": next((line for line in lines if line.startswith("auto:")), None),
            "prefixes": next((line for line in lines if line.startswith("prefixes:")), None),
            "completions": {r["id"]: r["completion"] for r in rows},  # the text: every run has it, --logprobs or not
            "token_ids": {r["id"]: r.get("token_ids") for r in rows},
            "depths": depths if name == "auto" else None,
            "acceptance_length": round((accepted + steps) / steps, 3) if steps else None,
            "masks": masks[0], "mask_us_per_token": round(masks[1] / summary.tokens * 1e6, 1) if masks[0] else None,
            "interrupted": summary.interrupted,
            "phases_s": _phases(timer, wall) if timer else None}


def _describe(phases: dict) -> str:
    return ", ".join(f"{p} {s}" for p, s in phases.items() if s)


def _phases(timer: PhaseTimer, wall: float) -> dict:
    """Seconds per decoder phase, and the job's time outside them ("other":
    reading rows, the warm-up, prefixes prefilled, shards and views)."""
    phases = {p: round(timer.seconds.get(p, 0.0), 3) for p in PHASES}
    return {**phases, "other": round(wall - sum(phases.values()), 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jobs.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="examples/prompts.jsonl")
    p.add_argument("--model", default="models/qwen3-next-tiny-stdlib")
    p.add_argument("--modes", nargs="+", default=["baseline", "auto"], type=lambda t: mode_spec(t) and t,
                   help="MODE or MODE:K (K drafts; at most K under auto), then any ,SETTING=VALUE of the job "
                        "(e.g. baseline,prefix_sharing=false); the first is the reference of ratios and completions")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--limit", type=int)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--draft-tokens", type=int, default=3)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0], help="0: greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--synthetic", choices=sorted(SYNTHETIC),
                   help="a random 4-bit model of these shapes over generated prompts (costs only: pair with "
                        "--acceptance-profile); --dataset and --model are then not read")
    p.add_argument("--acceptance-profile", type=_argument(parse_profile),
                   help="project drafts at this cumulative profile (e.g. 0.93,0.82,0.64) onto the first mode's "
                        "first run's tokens; the first mode must be baseline")
    p.add_argument("--profile-after", type=_argument(parse_later), metavar="N:PROFILE",
                   help="with --acceptance-profile: from N new tokens on, project at PROFILE instead "
                        "(acceptance that falls with context)")
    p.add_argument("--prompts", type=int, default=64, help="with --synthetic: how many prompts")
    p.add_argument("--prompt-tokens", type=int, default=1024, help="with --synthetic: tokens per prompt")
    p.add_argument("--shared-prefix", type=int, nargs=3, metavar=("PREFIX", "MIN", "MAX"),
                   help="with --synthetic: rows share a system prompt of PREFIX tokens, each with its own suffix "
                        "of MIN..MAX tokens (python -m jobs.prefix_data)")
    p.add_argument("--phase-times", action="store_true",
                   help="time each decoder phase (synchronizing after each: for where time goes, not throughput)")
    p.add_argument("--json", help="write the report here")
    args = p.parse_args(argv)
    if args.shared_prefix and (not args.synthetic or min(args.shared_prefix) < 1
                               or args.shared_prefix[1] > args.shared_prefix[2]):
        p.error("--shared-prefix needs --synthetic and positive PREFIX MIN MAX with MIN <= MAX")
    if args.acceptance_profile:
        if mode_spec(args.modes[0])[0] != "baseline":
            p.error("--acceptance-profile needs baseline as the first mode (its tokens are the projection's)")
        other = [m for m in args.modes if mode_spec(m)[0] not in ("baseline", "chain", "auto")]
        if other:
            p.error(f"--acceptance-profile projects chain drafts: modes baseline, chain and auto, not {other[0]}")
    runs, stopped = [], None
    with tempfile.TemporaryDirectory() as tmp:
        if args.synthetic:
            engine, args.model, args.dataset = synthetic_job(args.synthetic, Path(tmp), args.prompts,
                                                             args.prompt_tokens, args.seed, args.shared_prefix)
        else:
            engine = MTPEngine.load(args.model)
        references = {}  # per temperature: the first baseline run's tokens, which projected drafts follow
        schedule = [(temperature, r, mode) for temperature in args.temperatures for r in range(args.rounds)
                    for mode in args.modes[r % len(args.modes):] + args.modes[: r % len(args.modes)]]
        for temperature, r, mode in schedule:
            out = Path(tmp) / f"{mode}-{temperature}-{r}"
            run = run_once(engine, args.dataset, args.model, out, mode, temperature, args, references.get(temperature))
            if run["interrupted"]:  # a stopped job's figures are not a run's: report the runs before it
                stopped = f"stopped by {run['interrupted']} during T={temperature} round {r + 1} {mode}"
                print(stopped, file=sys.stderr, flush=True)
                break
            if args.acceptance_profile:
                references.setdefault(temperature, run["token_ids"])
            run["round"] = r
            runs.append(run)
            print(f"T={temperature} round {r + 1}/{args.rounds} {mode}: {run['tok_s']} tok/s "
                  f"({run['tokens']} tokens, {run['wall_s']} s"
                  + (f", warm-up {run['warmup_s']} s" if run["warmup_s"] else "")
                  + f", {run['decode_tok_s']} tok/s without prefill, acceptance length {run['acceptance_length']}"
                  + (f", {run['masks']} masks, {run['mask_us_per_token']} us of masks per token"
                     if run["masks"] else "") + ")"
                  + (f"\n  {run['controller']}" if run["controller"] else "")
                  + (f"\n  {run['prefixes']}" if run["prefixes"] else "")
                  + (f"\n  phases (s): {_describe(run['phases_s'])}" if run["phases_s"] else ""),
                  file=sys.stderr, flush=True)
    summary = []
    for temperature in args.temperatures:
        here = [run for run in runs if run["temperature"] == temperature]
        reference = [run for run in here if run["mode"] == args.modes[0]]
        if not reference:
            continue
        ref_rate = statistics.mean(run["tok_s"] for run in reference)
        for mode in args.modes:
            mine = [run for run in here if run["mode"] == mode]
            if not mine:
                continue
            rate = statistics.mean(run["tok_s"] for run in mine)
            # rows are compared with the first mode's, or with the first mode's of the same constraint
            twin = next(m for m in args.modes if _constraint(m) == _constraint(mode))
            ref_rows = next(r for r in here if r["mode"] == twin)["completions"]
            differing = max(sum(text != ref_rows.get(rid) for rid, text in run["completions"].items()) for run in mine)
            same = differing == 0
            depths = [sum(d) for d in zip(*[run["depths"] for run in mine])] if mine[0]["depths"] else None
            decode = statistics.mean(run["decode_tok_s"] for run in mine)
            ref_decode = statistics.mean(run["decode_tok_s"] for run in reference)
            summary.append({"temperature": temperature, "mode": mode, "tok_s": round(rate, 1),
                            "decode_ratio": round(decode / ref_decode, 3),
                            "acceptance_length": statistics.mean(run["acceptance_length"] or 1 for run in mine),
                            "rounds": [run["tok_s"] for run in mine], "ratio": round(rate / ref_rate, 3),
                            "same_completions": same, "rows_differing": differing, "depths": depths})
            print(f"T={temperature} {mode:>10}: {rate:8.1f} tok/s  {rate / ref_rate:5.2f}x (without prefill "
                  f"{decode / ref_decode:.2f}x)  rounds "
                  f"{[run['tok_s'] for run in mine]}  same rows: "
                  + ("True" if same else f"False ({differing} of {len(ref_rows)} differ in its worst round)")
                  + (f"  depths chosen {depths}" if depths else ""))
    label = None
    if args.acceptance_profile:
        label = f"projected at profile {','.join(map(str, args.acceptance_profile))}"
        if args.profile_after:
            label += f", from {args.profile_after[0]} new tokens {','.join(map(str, args.profile_after[1]))}"
    if label:
        print(f"({label}: drafts are the true continuation kept with the profile's probabilities, not measured)")
    if not all(s["same_completions"] for s in summary):
        print("(rows that differ from the first mode's: `python -m jobs audit DIR` says whether each first parting "
              "is a numerical near-tie, as batched half-precision forwards give on a GPU)", file=sys.stderr)
    report = {"date": time.strftime("%Y-%m-%d"), "machine": platform.platform(), "device": str(mx.default_device()),
              "model": f"synthetic {args.synthetic} (random 4-bit weights)" if args.synthetic else args.model,
              "acceptance": label or "measured",
              "settings": {k: v for k, v in vars(args).items() if k != "json"}, "summary": summary, "stopped": stopped,
              "runs": [{k: v for k, v in run.items() if k not in ("completions", "token_ids")} for run in runs]}
    if args.json:
        Path(args.json).write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    return 1 if stopped or not all(s["same_completions"] for s in summary) else 0


if __name__ == "__main__":
    sys.exit(main())

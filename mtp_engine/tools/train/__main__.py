"""``python -m mtp_engine.train {prepare,prompts,fit,distill,best,portable,export,measure}``.

    prepare   corpus (standard library + dependency sources) -> BPE tokenizer, token arrays
    prompts   held-out functions -> examples/prompts.jsonl (signature + docstring)
    fit       train a model and its MTP head from scratch (PyTorch; resumable)
    distill   retrain a fit's MTP head on the trunk's own continuations (PyTorch; resumable)
    best      the fit run with the lowest held-out perplexity among folders
    portable  a bfloat16 copy of a run's latest step, to move it off a machine
    export    a run's latest step -> Hub-layout model folder (MLX)
    measure   perplexity, loops and acceptance on the held-out prompts -> model card (MLX)

fit and distill run in PyTorch (the training machine has no MLX; the engine
never imports them) and write a checkpoint every few minutes; ``--detach``
starts them in a new session, logging to ``OUT/train.log``, so they outlive
the shell that started them; ``--resume DIR`` continues from a run's folder,
a step folder or a portable copy. The model card (``models/*/README.md``)
gives the whole procedure.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

# Model shapes the scaling runs use: all 8 layers (6 gated-delta, 2 gated
# attention), a 3072-token vocabulary, 4 experts top-2 plus a shared expert.
PRESETS = {
    "small": dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, linear_num_value_heads=4,
                  linear_num_key_heads=2, moe_intermediate_size=128, shared_expert_intermediate_size=128,
                  intermediate_size=512),
    "medium": dict(hidden_size=320, num_attention_heads=4, num_key_value_heads=2, linear_num_value_heads=4,
                   linear_num_key_heads=2, moe_intermediate_size=160, shared_expert_intermediate_size=160,
                   intermediate_size=640),
    "large": dict(hidden_size=384, num_attention_heads=6, num_key_value_heads=2, linear_num_value_heads=6,
                  linear_num_key_heads=3, moe_intermediate_size=192, shared_expert_intermediate_size=192,
                  intermediate_size=768),
}
BASE = dict(
    architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", num_hidden_layers=8, head_dim=64,
    linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=4,
    num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, rms_norm_eps=1e-6,
    vocab_size=3072, rope_theta=10000.0, partial_rotary_factor=0.25, max_position_embeddings=8192,
    full_attention_interval=4, tie_word_embeddings=False, attention_bias=False, rope_scaling=None,
    mtp_num_hidden_layers=1, torch_dtype="bfloat16",
)


def model_config(preset: str, overrides: str | None) -> dict:
    if preset not in PRESETS:
        sys.exit(f"--preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    config = {**BASE, **PRESETS[preset]}
    try:
        config.update(json.loads(overrides or "{}"))
    except json.JSONDecodeError as e:
        sys.exit(f"--config-overrides is not JSON: {e}")
    return config


def detach(argv: list[str], log: Path) -> None:
    """Run this command again without ``--detach`` in a new session (it
    survives the shell and its hang-up), output appended to ``log``."""
    argv = [a for a in argv if a != "--detach"]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mtp_engine.train", *argv], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    print(f"started pid {proc.pid}, logging to {log}")


def cmd_prepare(args) -> None:
    """Corpus (standard library and dependency sources) -> tokenizer and token arrays."""
    import numpy as np

    from mtp_engine.io.hub_writer import train_bpe_tokenizer
    from mtp_engine.tools.train.corpus import build_corpus, describe, read_source, tokenize_files

    out = Path(args.data)
    out.mkdir(parents=True, exist_ok=True)
    corpus = build_corpus()
    train_files = [p for _, p in corpus.train]
    texts = (t for t in (read_source(p) for p in train_files) if t)
    if args.tokenizer:  # continue training a model: its own tokenizer
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(args.tokenizer)
    else:
        tokenizer = train_bpe_tokenizer(texts, args.vocab_size)
    tokenizer.save(str(out / "tokenizer.json"))
    train = tokenize_files(tokenizer, train_files)
    held = tokenize_files(tokenizer, [p for p in corpus.held_out if not p.stem.startswith("test_")])
    np.save(out / "train.npy", train)
    np.save(out / "heldout.npy", held)
    info = {
        **describe(),
        "train_files": len(train_files),
        "held_out_files": len(corpus.held_out),
        "dropped_files": corpus.dropped,
        "train_tokens": int(train.size),
        "held_out_tokens": int(held.size),
        "vocab_size": tokenizer.get_vocab_size(),
        "sources": corpus.sources,
    }
    (out / "corpus.json").write_text(json.dumps(info, indent=2))
    print(json.dumps({k: v for k, v in info.items() if k != "sources"}, indent=2))


def cmd_prompts(args) -> None:
    import orjson

    from mtp_engine.tools.train.corpus import held_out_prompts

    prompts = held_out_prompts()
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        for p in prompts:
            f.write(orjson.dumps({"id": p.id, "prompt": p.prompt, "reference": p.reference}) + b"\n")
    print(f"{len(prompts)} prompts -> {path}")


def _settings(cls, args, names: list[str]):
    from mtp_engine.tools.train.trainer import settings_from

    values = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    try:
        return settings_from(cls, values)
    except ValueError as e:
        sys.exit(f"{args.command}: {e}")


COMMON = ["seq_len", "batch_size", "steps", "lr", "min_lr", "warmup", "eval_every", "max_seconds", "seed",
          "checkpoint_minutes", "log_every"]


def cmd_fit(args, argv) -> None:
    out = Path(args.out)
    if args.detach:
        return detach(argv, out / "train.log")
    from mtp_engine.tools.train.checkpoint import read_checkpoint
    from mtp_engine.tools.train.trainer import FitSettings, Log, fit

    settings = _settings(FitSettings, args, COMMON + ["unlikelihood", "ul_batch", "prefix_len", "new_tokens",
                                                      "pool_sequences", "regenerate_every"])
    if args.no_compile:
        settings.compile = False
    try:
        if args.resume:
            config = read_checkpoint(Path(args.resume), with_optimizer=False)[0]
        else:
            config = model_config(args.preset, args.config_overrides)
        fit(config, Path(args.data), out, settings, Path(args.resume) if args.resume else None, Log(out / "train.log"))
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"fit: {e}")


def cmd_distill(args, argv) -> None:
    out = Path(args.out)
    if args.detach:
        return detach(argv, out / "train.log")
    from mtp_engine.tools.train.trainer import DistillSettings, Log, distill

    settings = _settings(DistillSettings, args, COMMON + ["hard_weight", "corpus_fraction", "prefix_len",
                                                          "pool_sequences", "regenerate_every"])
    if args.no_compile:
        settings.compile = False
    if args.depth_weights:
        settings.depth_weights = tuple(float(w) for w in args.depth_weights.split(","))
    if args.temperatures:
        settings.temperatures = tuple(float(t) for t in args.temperatures.split(","))
    try:
        settings.__post_init__()
        distill(Path(args.source), Path(args.data), out, settings, Path(args.resume) if args.resume else None,
                Log(out / "train.log"))
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"distill: {e}")


def cmd_best(args) -> None:
    """Print the folder whose latest evaluation has the lowest perplexity."""
    from mtp_engine.tools.train.checkpoint import read_checkpoint

    scored = []
    for folder in args.folders:
        try:
            _, _, progress = read_checkpoint(Path(folder), with_optimizer=False)
        except (FileNotFoundError, ValueError) as e:
            print(f"skipping {folder}: {e}", file=sys.stderr)
            continue
        if progress.get("history"):
            scored.append((progress["history"][-1]["perplexity"], folder))
    if not scored:
        sys.exit("no folder holds an evaluated run")
    print(min(scored)[1])


def cmd_portable(args) -> None:
    from mtp_engine.tools.train.checkpoint import latest_step, write_portable

    step = latest_step(Path(args.run))
    if step is None:
        sys.exit(f"{args.run}: no checkpoint step yet")
    for path in write_portable(step, Path(args.out)):
        print(path)


def cmd_export(args) -> None:
    from mtp_engine.tools.train.export import export_checkpoint, parameter_count

    corpus = Path(args.data) / "corpus.json"
    extra = {"corpus": json.loads(corpus.read_text())} if corpus.exists() else {}
    if args.scaling:
        runs = json.loads(Path(args.scaling).read_text())
        extra["scaling"] = {name: {**run, "parameters": parameter_count(run["config"])}
                            for name, run in sorted(runs.items()) if name.startswith("fit-")}
    out = export_checkpoint(Path(args.checkpoint), Path(args.out), Path(args.data) / "tokenizer.json", extra)
    print(f"wrote {out}")


def cmd_measure(args) -> None:
    from mtp_engine.tools.train.card import measure_and_write_card

    measure_and_write_card(Path(args.model), Path(args.prompts), max_tokens=args.max_tokens, limit=args.limit,
                           data=Path(args.data))


def _run_args(p: argparse.ArgumentParser, out: str) -> None:
    p.add_argument("--data", default=".train-data", help="folder of prepare's outputs (train.npy, heldout.npy)")
    p.add_argument("--out", default=out, help="the run's folder: checkpoints and train.log")
    p.add_argument("--resume", help="continue from this run folder, step folder or portable copy")
    p.add_argument("--detach", action="store_true", help="run in a new session, logging to OUT/train.log")
    p.add_argument("--no-compile", action="store_true", help="do not torch.compile the loss")
    for name, kind in (("seq-len", int), ("batch-size", int), ("steps", int), ("lr", float), ("min-lr", float),
                       ("warmup", int),
                       ("eval-every", int), ("max-seconds", float), ("seed", int), ("checkpoint-minutes", float),
                       ("log-every", int)):
        p.add_argument(f"--{name}", type=kind, default=None)


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m mtp_engine.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="build the tokenizer and token arrays")
    p.add_argument("--data", default=".train-data")
    p.add_argument("--vocab-size", type=int, default=3072)
    p.add_argument("--tokenizer", help="tokenize with this tokenizer.json (a model's, to continue training it) "
                                       "instead of training one")
    p = sub.add_parser("prompts", help="write held-out prompts")
    p.add_argument("--out", default="examples/prompts.jsonl")
    p = sub.add_parser("fit", help="train a model and its head (PyTorch)")
    _run_args(p, ".train-runs/fit")
    p.add_argument("--preset", default="large", help=f"model shape: {', '.join(PRESETS)} (default: large)")
    p.add_argument("--config-overrides", help="JSON dict of config.json overrides")
    p.add_argument("--unlikelihood", type=float, default=None,
                   help="weight of sequence-level unlikelihood on the trunk's looping greedy continuations "
                        "(0 = off; for tuning a fitted model, with --resume)")
    for name, kind in (("ul-batch", int), ("prefix-len", int), ("new-tokens", int), ("pool-sequences", int),
                       ("regenerate-every", int)):
        p.add_argument(f"--{name}", type=kind, default=None)
    p = sub.add_parser("distill", help="retrain a fit's head on the trunk's continuations (PyTorch)")
    _run_args(p, ".train-runs/distill")
    p.add_argument("--source", required=True, help="the fit run whose head is distilled")
    for name, kind in (("hard-weight", float), ("corpus-fraction", float), ("prefix-len", int),
                       ("pool-sequences", int), ("regenerate-every", int)):
        p.add_argument(f"--{name}", type=kind, default=None)
    p.add_argument("--depth-weights", help="comma-separated loss weight per draft depth (their count is the depth)")
    p.add_argument("--temperatures", help="comma-separated temperatures of the trunk's continuations (0 = greedy)")
    p = sub.add_parser("best", help="the run folder with the lowest held-out perplexity")
    p.add_argument("folders", nargs="+")
    p = sub.add_parser("portable", help="bfloat16 copy of a run's latest step")
    p.add_argument("run")
    p.add_argument("out")
    p = sub.add_parser("export", help="a run's latest step -> Hub-layout model folder")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--out", default="models/qwen3-next-tiny-stdlib")
    p.add_argument("--data", default=".train-data", help="holds tokenizer.json and corpus.json")
    p.add_argument("--scaling", help="the runs' progress (h200.sh poll's scaling.json) for the card's scaling table")
    p = sub.add_parser("measure", help="measure the model and write its card")
    p.add_argument("--model", default="models/qwen3-next-tiny-stdlib")
    p.add_argument("--prompts", default="examples/prompts.jsonl")
    p.add_argument("--data", default=".train-data", help="holds heldout.npy (perplexity)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, default=None)
    args = parser.parse_args(argv)
    if args.command in ("fit", "distill"):
        {"fit": cmd_fit, "distill": cmd_distill}[args.command](args, argv)
    else:
        {"prepare": cmd_prepare, "prompts": cmd_prompts, "best": cmd_best, "portable": cmd_portable,
         "export": cmd_export, "measure": cmd_measure}[args.command](args)


if __name__ == "__main__":
    main()

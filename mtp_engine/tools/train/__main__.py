"""``python -m mtp_engine.train {prepare,prompts,fit,measure}``.

    prepare  stdlib corpus -> BPE tokenizer and token arrays (train / held-out)
    prompts  held-out functions -> examples/prompts.jsonl (signature + docstring)
    fit      train the model and its MTP head; write a Hub-layout checkpoint
    distill  retrain a checkpoint's MTP head on its own trunk's predictions
    measure  acceptance of every mode on the held-out prompts -> model card
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import numpy as np
import orjson
from tokenizers import Tokenizer

from mtp_engine.io.hub_writer import (
    replace_mtp_head,
    train_bpe_tokenizer,
    write_checkpoint,
)
from mtp_engine.model.loader import load_checkpoint
from mtp_engine.options import EngineOptions
from mtp_engine.tools.train.card import measure_and_write_card
from mtp_engine.tools.train.corpus import (
    describe,
    held_out_prompts,
    read_source,
    stdlib_files,
    tokenize_files,
)
from mtp_engine.tools.train.distill import DistillSettings, distill
from mtp_engine.tools.train.fit import (
    TrainSettings,
    settings_dict,
    shipped_config,
    train,
)


def cmd_prepare(args) -> None:

    out = Path(args.data)
    out.mkdir(parents=True, exist_ok=True)
    train_files, held_files = stdlib_files()
    texts = (t for t in (read_source(p) for p in train_files) if t)
    tokenizer = train_bpe_tokenizer(texts, args.vocab_size)
    tokenizer.save(str(out / "tokenizer.json"))
    train = tokenize_files(tokenizer, train_files)
    held = tokenize_files(tokenizer, [p for p in held_files if not p.stem.startswith("test_")])
    np.save(out / "train.npy", train)
    np.save(out / "heldout.npy", held)
    info = {
        **describe(),
        "train_files": len(train_files),
        "held_out_files": len(held_files),
        "train_tokens": int(train.size),
        "held_out_tokens": int(held.size),
        "vocab_size": tokenizer.get_vocab_size(),
    }
    (out / "corpus.json").write_text(json.dumps(info, indent=2))
    print(json.dumps(info, indent=2))


def cmd_prompts(args) -> None:


    prompts = held_out_prompts()
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        for p in prompts:
            f.write(orjson.dumps({"id": p.id, "prompt": p.prompt, "reference": p.reference}) + b"\n")
    print(f"{len(prompts)} prompts -> {path}")


def cmd_fit(args) -> None:


    data = Path(args.data)
    config = shipped_config(**json.loads(args.config_overrides or "{}"))
    tokenizer = Tokenizer.from_file(str(data / "tokenizer.json"))
    if tokenizer.get_vocab_size() > config["vocab_size"]:
        sys.exit(f"tokenizer has {tokenizer.get_vocab_size()} tokens, more than vocab_size {config['vocab_size']}")
    settings = TrainSettings(
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        steps=args.steps,
        lr=args.lr,
        warmup=min(args.warmup, max(args.steps // 10, 1)),
        eval_every=args.eval_every,
        max_seconds=args.max_seconds,
        seed=args.seed,
        compile=not args.no_compile,
    )
    train_tokens = np.load(data / "train.npy")
    held_tokens = np.load(data / "heldout.npy")
    started = time.time()
    trainee, history = train(config, train_tokens, held_tokens, settings, Path(args.state), log=lambda m: print(m, flush=True))
    out = Path(args.out)
    write_checkpoint(out, config, trainee.model, trainee.head, tokenizer, dtype=mx.bfloat16)
    corpus = json.loads((data / "corpus.json").read_text())
    training = {
        "settings": settings_dict(settings),
        "steps_done": history[-1]["step"],
        "tokens_seen": history[-1]["step"] * settings.batch_size * settings.seq_len,
        "seconds": round(time.time() - started, 1),
        "device": str(mx.default_device()),
        "history": history,
        "corpus": corpus,
    }
    (out / "training.json").write_text(json.dumps(training, indent=2))
    print(f"wrote {out}: {json.dumps(history[-1])}")


def distill_settings(args, weights: tuple[float, ...]):
    """`DistillSettings` from the ``distill`` arguments (ValueError names a bad one)."""

    return DistillSettings(
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        steps=args.steps,
        lr=args.lr,
        warmup=min(args.warmup, max(args.steps // 10, 1)),
        depth_weights=weights,
        hard_weight=args.hard_weight,
        generated_fraction=args.generated_fraction,
        prefix_len=args.prefix_len,
        eval_every=args.eval_every,
        max_seconds=args.max_seconds,
        seed=args.seed,
        compile=not args.no_compile,
    )


def cmd_distill(args) -> None:



    try:
        weights = tuple(float(w) for w in args.depth_weights.split(","))
    except ValueError:
        sys.exit(f"--depth-weights must be comma-separated numbers, got {args.depth_weights!r}")
    try:
        settings = distill_settings(args, weights)
    except ValueError as e:
        sys.exit(f"distill: {e}")
    data = Path(args.data)
    for name in ("train.npy", "heldout.npy"):
        if not (data / name).exists():
            sys.exit(f"{data / name} not found: run `python -m mtp_engine.train prepare --data {data}` "
                     "or pass --data with a folder holding train.npy and heldout.npy (token ids)")
    train_tokens = np.load(data / "train.npy")
    held_tokens = np.load(data / "heldout.npy")
    for name, tokens in (("train.npy", train_tokens), ("heldout.npy", held_tokens)):
        if tokens.ndim != 1 or len(tokens) <= settings.seq_len:
            sys.exit(f"{data / name} must be a 1-D token array longer than --seq-len {settings.seq_len}, "
                     f"got shape {tokens.shape}")
    loaded = load_checkpoint(args.model, dtype="float32", options=EngineOptions.from_env(compile_layers=False))
    started = time.time()
    out = Path(args.out)
    training = out / "training.json"
    source_training = loaded.path / "training.json"
    info = json.loads(source_training.read_text()) if source_training.exists() else {}

    def save(history: list[dict]) -> None:
        # After every evaluation: the head so far, and the run so far.
        replace_mtp_head(loaded.path, out, loaded.head)
        record = {
            "source": str(args.model),
            "settings": asdict(settings),
            "steps_done": history[-1]["step"],
            "tokens_seen": history[-1].get("tokens", 0),
            "seconds": round(time.time() - started, 1),
            "device": str(mx.default_device()),
            "history": history,
        }
        runs = info.get("head_distillation", [])
        runs = runs if isinstance(runs, list) else [runs]
        tmp = training.with_name(training.name + ".tmp")
        tmp.write_text(json.dumps({**info, "head_distillation": runs + [record]}, indent=2))
        tmp.replace(training)

    history = distill(loaded.model, loaded.head, train_tokens, held_tokens, settings,
                      log=lambda m: print(m, flush=True), on_eval=save)
    print(f"wrote {out}: {json.dumps(history[-1])}")


def cmd_measure(args) -> None:

    measure_and_write_card(Path(args.model), Path(args.prompts), max_tokens=args.max_tokens, limit=args.limit)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mtp_engine.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="build the tokenizer and token arrays")
    p.add_argument("--data", default=".train-data")
    p.add_argument("--vocab-size", type=int, default=3072)
    p = sub.add_parser("prompts", help="write held-out prompts")
    p.add_argument("--out", default="examples/prompts.jsonl")
    p = sub.add_parser("fit", help="train and export")
    p.add_argument("--data", default=".train-data")
    p.add_argument("--out", default="models/qwen3-next-tiny-stdlib")
    p.add_argument("--state", default=".train-state")
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--max-seconds", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-compile", action="store_true", help="do not mx.compile the training step")
    p.add_argument("--config-overrides", help="JSON dict of config.json overrides (e.g. smaller tests)")
    p = sub.add_parser("distill", help="retrain the MTP head on the trunk's own predictions")
    p.add_argument("--model", default="models/qwen3-next-tiny-stdlib")
    p.add_argument("--out", required=True, help="output folder (may equal --model to update it in place)")
    p.add_argument("--data", default=".train-data")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--depth-weights", default="1.0,0.8,0.6,0.4",
                   help="loss weight of each chained draft step; their count is the depth trained")
    p.add_argument("--hard-weight", type=float, default=1.0,
                   help="weight of the trunk's argmax against its softmax in the targets (0..1)")
    p.add_argument("--generated-fraction", type=float, default=0.25,
                   help="share of windows that are the trunk's own greedy continuations")
    p.add_argument("--prefix-len", type=int, default=32, help="corpus prefix of a generated window")
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--max-seconds", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-compile", action="store_true", help="do not mx.compile the training step")
    p = sub.add_parser("measure", help="measure acceptance and write the model card")
    p.add_argument("--model", default="models/qwen3-next-tiny-stdlib")
    p.add_argument("--prompts", default="examples/prompts.jsonl")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, default=None)
    args = parser.parse_args(argv)
    {"prepare": cmd_prepare, "prompts": cmd_prompts, "fit": cmd_fit, "distill": cmd_distill,
     "measure": cmd_measure}[args.command](args)


if __name__ == "__main__":
    main()

"""Command line: ``python -m jobs generate|status|repair|merge|export|audit ...``.

The CLI only parses: it builds a `JobConfig` (flags over a YAML/JSON config
file over defaults) and calls the runner. Each command imports what it
runs when it runs (mlx-lm, pyarrow and datasets take seconds to
import), so ``--help`` and a usage error answer at once.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jobs.config import ConfigError, JobConfig, read_config_file
from mtp_engine.modes import DRAFTERS, MODES, DecodeConfig
from mtp_engine.modes import HELP as DECODE_HELP
from mtp_engine.sampling import HELP as SAMPLING_HELP
from mtp_engine.sampling import SAMPLERS, SamplingParams

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_SIGINT, EXIT_SIGTERM = 0, 1, 2, 130, 143


def _json_object(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jobs",
        description="Batch generation with lossless MTP speculative decoding on MLX.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser(
        "generate",
        help="run or resume a generation job",
        description=(
            "Generate a completion for every row of a prompt dataset and write them as Arrow "
            "shards that datasets.load_from_disk reads. Running the same command again resumes: "
            "rows already committed are skipped, rows in flight at a crash are redone."
        ),
    )
    g.add_argument("--config", help="YAML or JSON file with any of the settings below (flags override it)")
    g.add_argument("--dataset", help="prompt file (.jsonl .json .csv .parquet .arrow), glob, or save_to_disk folder")
    g.add_argument("--model", help="Qwen3-Next or Qwen3.5 checkpoint with its MTP head: a folder, or a Hugging Face "
                   "Hub id (org/name) from the local Hub cache, downloaded where the network allows")
    g.add_argument("--output", help="output folder (created; resumed if it holds this job)")
    g.add_argument("--mode", choices=MODES, help="decoding mode, --batch-size rows at once; 'auto' (the "
                   "default) chooses each step's drafts, 0 (plain) to --draft-tokens, from the acceptance and step "
                   "costs it measures; 'baseline' is plain batching; 'chain' always drafts --draft-tokens. Every mode "
                   "writes the same rows")
    g.add_argument("--max-tokens", type=int, help="tokens per completion unless a row sets max_tokens (default: 256)")
    g.add_argument("--stop", action="append", help="stop string (repeatable) unless a row sets stop")
    g.add_argument("--batch-size", type=int, help="rows decoded at once; 1 decodes one row at a time (default: "
                   "32 in the auto, chain and baseline modes, 1 in the tree modes)")
    g.add_argument("--rows-per-shard", type=int, help="rows per committed shard (default: 256)")
    g.add_argument("--commit-seconds", type=float, help="commit finished rows at least this often, in seconds: a crash loses at most this much "
                   "work (default: 60; a commit costs ~5 ms)")
    g.add_argument("--prompt-field", help="field holding the prompt string (default: prompt)")
    g.add_argument("--messages-field", help="field holding chat messages (default: messages)")
    g.add_argument("--id-field", help="field holding the row id; rows without it use their row number (default: id)")
    g.add_argument("--system-prompt", help="system message prepended to chat rows that have none")
    g.add_argument("--chat-template", metavar="FILE", help="Jinja chat template rendering chat rows instead of the "
                   "model's own")
    g.add_argument("--chat-template-kwargs", metavar="JSON", type=_json_object,
                   help="extra chat template variables as a JSON object, e.g. '{\"enable_thinking\": false}'")
    g.add_argument("--limit", type=int, help="only the first N rows of the dataset")
    g.add_argument("--n", type=int, help="completions per prompt, one output row each (default: 1). Rows may "
                   "set n, temperature, top_p, top_k, min_p and seed themselves")
    for helps, defaults in ((DECODE_HELP, DecodeConfig()), (SAMPLING_HELP, SamplingParams())):
        for name in helps:  # one declaration each: the dataclass's type and default, its help line
            default = getattr(defaults, name)
            kind = {"sampler": None, "drafter": None}.get(name, type(default))
            choices = {"sampler": SAMPLERS, "drafter": DRAFTERS}.get(name)
            if kind is bool:
                g.add_argument(f"--{name.replace('_', '-')}", action=argparse.BooleanOptionalAction, default=None,
                               help=f"{helps[name]} (default: {default})")
            else:
                g.add_argument(f"--{name.replace('_', '-')}", type=kind, choices=choices,
                               help=f"{helps[name]} (default: {default})")
    g.add_argument("--fast-path", dest="fast_paths", action="append", metavar="NAME=VALUE",
                   help="set one engine fast path (repeatable), e.g. cpp_drafter=off, few_rows=16, "
                   "compile_layers=auto; names in docs/BACKENDS.md. They change speed, never output")
    g.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=None,
                   help="meet every decoding step shape once before the first row, so no row pays a kernel's "
                   "first use (default: on a GPU, off on the CPU, where first uses cost nothing)")
    g.add_argument(
        "--overwrite",
        action="store_true",
        default=None,
        help="delete the output folder's results and start over (needed when the model, "
        "template or decoding parameters changed)",
    )

    g.add_argument("--allow-dataset-change", action="store_true", default=None,
                   help="resume a folder written from another dataset, adding this dataset's rows to it")
    g.add_argument("--logprobs", type=int, metavar="N", help="store each generated token's log-probability and its "
                   "N likeliest alternatives, 0..20 (default: none; rows may set logprobs)")
    g.add_argument("--json-schema", metavar="FILE", help="a JSON schema every completion must match, unless a row "
                   "sets response_format, json_schema, regex or choices (default: none)")
    g.add_argument("--regex", help="a regular expression every completion must match (as --json-schema)")
    g.add_argument("--choices", metavar="A,B,...", help="the strings a completion must be one of, comma-separated "
                   "or a JSON list (as --json-schema)")
    g.add_argument("--keep-columns", metavar="all|none|NAME,...", help="input columns every output row carries, as "
                   "text (default: all whose names no output column has, e.g. a reference answer or messages)")
    g.add_argument("--prefix-sharing", action=argparse.BooleanOptionalAction, default=None,
                   help="prefill prompt prefixes that rows share (a system prompt) once, each row only its own "
                   "suffix; speed only (default: on)")
    g.add_argument("--prefix-min-tokens", type=int, help="the shortest shared run of tokens worth prefilling once "
                   "(default: 256)")
    g.add_argument("--prefix-cache-gb", type=float, help="memory for the kept prefixes, least recently used "
                   "evicted first (default: 5%% of the machine's memory, at most 4)")
    g.add_argument("--max-error-rate", type=float, help="exit 1 when more than this share of the run's rows are "
                   "error rows (bad input, failed generations); they stay committed (default: 0.5)")
    g.add_argument("--quiet", action="store_true", default=None,
                   help="print only notes, warnings and the result (no job line, fast paths or progress)")
    g.add_argument("--verbose", action="store_true", default=None,
                   help="print each engine fast path's state on its own line")

    s = sub.add_parser("status", help="summarise a job's output folder and check that it is intact")
    s.add_argument("output", help="output folder of a job")
    s.add_argument("--verify", action="store_true", help="check every shard's CRC-32 too (sizes are always checked)")

    r = sub.add_parser("repair", help="rebuild a job folder's ledgers from its shards",
                       description="Rebuild every ledger of a job folder from its shards (for a ledger damaged "
                       "in the middle); unreadable shards go to quarantine/. Resume the job afterwards.")
    r.add_argument("output", help="output folder of a job")

    m = sub.add_parser(
        "merge",
        help="combine output folders of the same job (machines without a shared filesystem)",
        description="Combine job output folders that share a fingerprint; overlapping ids are refused.",
    )
    m.add_argument("inputs", nargs="+", help="output folders to merge")
    m.add_argument("--output", required=True, help="folder for the merged result (new or empty)")

    e = sub.add_parser("export", help="write a job's completions as one Parquet, JSON lines or OpenAI batch file",
                       description="Write a job folder's committed rows, in input order, as one file: Parquet "
                       "(pandas, polars, duckdb and pyarrow.dataset open it), JSON lines, or an OpenAI batch "
                       "output file (one line per prompt whose completions are all committed).")
    e.add_argument("output_dir", metavar="DIR", help="output folder of a job")
    e.add_argument("--format", required=True, choices=["parquet", "jsonl", "openai-batch"], help="file format")
    e.add_argument("--output", required=True, help="file to write (.parquet or .jsonl)")

    a = sub.add_parser("audit", help="check a job's rows against plain decoding (the lossless contract)",
                       description="Decode a sample of a job folder's rows again with plain decoding and report "
                       "each as identical, parted at a numerical near-tie, or diverged (exit 1 on any divergence).")
    a.add_argument("output", help="output folder of a job")
    a.add_argument("--sample", type=int, help="audit this many rows, drawn at random (default: every row)")
    a.add_argument("--seed", type=int, default=0, help="seed of the draw (default 0)")
    a.add_argument("--dataset", help="the job's dataset, where the manifest's path does not reach it from here")
    a.add_argument("--json", help="write the report here too")
    return parser


def config_from_args(args: argparse.Namespace) -> JobConfig:
    file_values = read_config_file(args.config) if args.config else {}
    flags = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    return JobConfig.from_sources(file_values, flags)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        return _generate(args)
    if args.command == "status":
        from jobs.status import print_status

        return print_status(Path(args.output), verify=args.verify)
    if args.command == "repair":
        from jobs.repair import repair_folder

        return repair_folder(Path(args.output))
    if args.command == "merge":
        from jobs.merge import merge_outputs

        return merge_outputs([Path(p) for p in args.inputs], Path(args.output))
    if args.command == "export":
        from jobs.export import export_folder

        return export_folder(Path(args.output_dir), Path(args.output), args.format)
    if args.command == "audit":
        from jobs.audit import run_audit  # loads the model and mlx-lm's generation

        return run_audit(Path(args.output), args.sample, args.seed, args.dataset, args.json)
    return EXIT_USAGE


def _generate(args) -> int:
    try:
        config = config_from_args(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:  # Ctrl-C while MLX and the runner import is a start-up interrupt too
        from jobs.distributed import run_distributed_or_local
        from jobs.lock import FolderInUse
        from jobs.output import OutputError
        from jobs.prompts import TemplateStuck
        from jobs.readers import DatasetError
        from jobs.runner import resume_hint
        from mtp_engine.model.loader import CheckpointError
    except KeyboardInterrupt:
        print("interrupted before decoding started; nothing was written", file=sys.stderr)
        return EXIT_SIGINT
    try:
        summary = run_distributed_or_local(config)
    except KeyboardInterrupt:  # Ctrl-C before decoding started (loading the model, opening the folder)
        print("interrupted before decoding started; rows committed earlier are intact", file=sys.stderr)
        print(f"resume with: {resume_hint()}", file=sys.stderr)
        return EXIT_SIGINT
    except (FileNotFoundError, CheckpointError, DatasetError, OutputError, ConfigError, FolderInUse,
            TemplateStuck) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as e:  # reading the model or dataset
        print(f"error: {e.strerror or e} ({e.filename})" if e.filename else f"error: {e}", file=sys.stderr)
        return EXIT_FAILED

    rate = f", {summary.tokens / summary.elapsed_s:.1f} tok/s" if summary.elapsed_s > 0 else ""
    print(f"{'interrupted' if summary.interrupted else 'done'}: {summary.count()} committed "
          f"({summary.committed} this run, {summary.errors} errors, {summary.tokens} tokens){rate}", file=sys.stderr)
    print(f"output: {summary.output}  (datasets.load_from_disk({str(summary.output)!r}))", file=sys.stderr)
    if summary.interrupted:
        print(f"resume with: {resume_hint()}", file=sys.stderr)
        return EXIT_SIGTERM if summary.interrupted == "SIGTERM" else EXIT_SIGINT
    if summary.committed and summary.errors > config.max_error_rate * summary.committed:
        print(f"error: {summary.errors} of the {summary.committed} rows this run committed are error rows "
              f"({100 * summary.errors / summary.committed:.1f}%, above --max-error-rate {config.max_error_rate:g}); "
              "their `error` column says why", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK

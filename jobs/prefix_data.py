"""``python -m jobs.prefix_data``: a prompt dataset whose rows share long
prefixes, for benchmarks and tests of prefix sharing (`jobs.prefixes`).

    python -m jobs.prefix_data --rows 256 --prefix-tokens 512 --suffix-tokens 32 64 \\
        [--prefixes 1] [--model DIR] [--seed 0] --output FILE.jsonl

Each row's prompt is one of ``--prefixes`` system prompts (rows take them in
a shuffled order), a blank line, then a suffix of its own (its row number
first, so no two rows share more than the system prompt). Lengths are in
tokens of ``--model``'s tokenizer where given, else in words; a suffix's
length is drawn between the two ``--suffix-tokens`` values.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

WORDS = ("the of and to in is for that with as on by this be are from or at an it which not data value "
         "function return list file model time number string result first each new other use more can "
         "write read test case error line name type size order rule step state check change keep").split()


def _text(rng: random.Random, length: int, count) -> str:
    """Words until ``count(text)`` reaches ``length`` (each draw 90% of the
    words the tokens still missing take at the tokens per word so far, so a
    tokenizer that splits words does not overshoot)."""
    words = rng.choices(WORDS, k=1)
    while (have := count(" ".join(words))) < length:
        words += rng.choices(WORDS, k=max(1, int(0.9 * (length - have) * len(words) / max(have, 1))))
    return " ".join(words)


def make_rows(rows: int, prefix_tokens: int, suffix_tokens: tuple[int, int], prefixes: int = 1, seed: int = 0,
              count=lambda text: len(text.split())) -> list[dict]:
    rng = random.Random(seed)
    systems = [f"System prompt {p}. " + _text(rng, prefix_tokens, count) for p in range(prefixes)]
    order = [r % prefixes for r in range(rows)]
    rng.shuffle(order)
    out = []
    for r, p in enumerate(order):
        suffix = f"Row {r}: " + _text(rng, rng.randint(*suffix_tokens), count)
        out.append({"id": f"row-{r}", "prompt": f"{systems[p]}\n\n{suffix}", "prefix": p})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.prefix_data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--prefix-tokens", type=int, required=True, help="length of each system prompt")
    parser.add_argument("--suffix-tokens", type=int, nargs=2, default=[32, 64], metavar=("MIN", "MAX"))
    parser.add_argument("--prefixes", type=int, default=1, help="different system prompts")
    parser.add_argument("--model", help="count tokens with this checkpoint's tokenizer (default: words)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    if min(args.rows, args.prefix_tokens, args.prefixes, *args.suffix_tokens) < 1 or \
            args.suffix_tokens[0] > args.suffix_tokens[1]:
        parser.error("--rows, --prefix-tokens, --prefixes and --suffix-tokens must be positive, MIN <= MAX")
    count = lambda text: len(text.split())  # noqa: E731
    if args.model:
        from mtp_engine.model.loader import load_checkpoint_tokenizer

        tokenizer = load_checkpoint_tokenizer(args.model)
        count = lambda text: len(tokenizer.encode(text))  # noqa: E731
    rows = make_rows(args.rows, args.prefix_tokens, tuple(args.suffix_tokens), args.prefixes, args.seed, count)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} rows sharing {args.prefixes} system prompt(s) of {args.prefix_tokens} "
          f"{'tokens' if args.model else 'words'} -> {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

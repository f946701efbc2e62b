"""Sizes, acceptance and speed of the shipped model with a 4-bit trunk and
bf16, 8-bit and 4-bit MTP heads, next to the unquantized model.

    .venv/bin/python benchmarks/quantized_heads.py [--limit 40] [--max-tokens 96]

Each folder is made with `python -m mtp_engine.convert`; each mode's tokens
are checked against plain greedy decoding of the same folder.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import orjson

from mtp_engine import MTPEngine
from mtp_engine.convert import main as convert_main

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "models" / "qwen3-next-tiny-stdlib"


def folder_size(folder: Path, pattern: str = "*.safetensors") -> int:
    return sum(p.stat().st_size for p in folder.glob(pattern))


def measure(folder: Path, prompts: list[str], max_tokens: int) -> dict:
    engine = MTPEngine.load(folder)
    totals = {"baseline": [0, 0.0], "chain-k3": [0, 0.0]}
    steps = accepted = identical = 0
    for p in prompts[:2]:  # warm-up
        engine.generate(p, max_tokens=8)
        engine.generate(p, max_tokens=8, mode="chain")
    for p in prompts:
        t = time.perf_counter()
        base = engine.generate(p, max_tokens=max_tokens, mode="baseline")
        totals["baseline"][0] += len(base.tokens)
        totals["baseline"][1] += time.perf_counter() - t
        t = time.perf_counter()
        spec = engine.generate(p, max_tokens=max_tokens, mode="chain", draft_tokens=3)
        totals["chain-k3"][0] += len(spec.tokens)
        totals["chain-k3"][1] += time.perf_counter() - t
        steps += spec.stats.steps
        accepted += spec.stats.accepted
        identical += spec.tokens == base.tokens
    return {
        "acceptance_length_k3": round((accepted + steps) / steps, 3),
        "identical": f"{identical}/{len(prompts)}",
        "baseline_tok_s": round(totals["baseline"][0] / totals["baseline"][1], 1),
        "chain_k3_tok_s": round(totals["chain-k3"][0] / totals["chain-k3"][1], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--limit", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "quantized-heads-cpu.json"))
    args = parser.parse_args()
    rows = [orjson.loads(l) for l in (ROOT / "examples" / "prompts.jsonl").read_bytes().splitlines() if l.strip()]
    prompts = [r["prompt"] for r in rows[: args.limit]]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        variants = [("unquantized (bf16)", SHIPPED, None)]
        for label, bits in (("4-bit trunk + bf16 head", "none"), ("4-bit trunk + 8-bit head", "8"),
                            ("4-bit trunk + 4-bit head", "4")):
            out = Path(tmp) / bits
            assert convert_main(["--hf-path", str(SHIPPED), "--mlx-path", str(out), "-q", "--q-bits", "4",
                                 "--q-group-size", "64", "--mtp-bits", bits]) == 0
            variants.append((label, out, bits))
        for label, folder, _ in variants:
            head = folder / "mtp.safetensors"
            entry = {
                "variant": label,
                "weights_mb": round(folder_size(folder) / 1e6, 2),
                "head_mb": round(head.stat().st_size / 1e6, 2) if head.exists() else None,
                **measure(folder, prompts, args.max_tokens),
            }
            print(json.dumps(entry), flush=True)
            results.append(entry)
    base = results[0]["acceptance_length_k3"]
    for r in results:
        r["acceptance_vs_unquantized"] = round(r["acceptance_length_k3"] / base, 3)
    Path(args.out).write_text(json.dumps({"prompts": len(prompts), "max_tokens": args.max_tokens, "results": results}, indent=2))
    print("| variant | weights MB | head MB | acceptance K=3 | vs unquantized | identical | baseline tok/s | chain K=3 tok/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['variant']} | {r['weights_mb']} | {r['head_mb'] or '(in shards)'} | {r['acceptance_length_k3']} | "
              f"{r['acceptance_vs_unquantized']} | {r['identical']} | {r['baseline_tok_s']} | {r['chain_k3_tok_s']} |")


if __name__ == "__main__":
    main()

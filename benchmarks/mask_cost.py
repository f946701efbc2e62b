"""Per-token mask cost of the grammar libraries on this CPU.

Walks a valid instance of a JSON schema token by token, computing the mask
of allowed tokens before each token, with llguidance (the engine's choice,
`mtp_engine.constraints`) and outlines-core (when installed). xgrammar is
not measured: its Python API needs torch, which the engine does not depend on.

    python benchmarks/mask_cost.py --tokenizer TOKENIZER_JSON [--repeat 5]

The tokenizer is any Hugging Face ``tokenizer.json``; the figure that
matters is one with Qwen3-Next's ~151k tokens (docs/BENCHMARKS.md says
which one was used).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "kind": {"enum": ["function", "class", "module"]},
        "score": {"type": "number"},
        "count": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "owner": {"type": "object", "properties": {"id": {"type": "integer"}, "active": {"type": "boolean"}},
                  "required": ["id", "active"], "additionalProperties": False},
    },
    "required": ["name", "kind", "score", "count", "tags", "owner"],
    "additionalProperties": False,
}
INSTANCE = {"name": "parse_header", "kind": "function", "score": 0.875, "count": 12,
            "tags": ["io", "email", "parser"], "owner": {"id": 7, "active": True}}


def llguidance_cost(tokenizer_json: str, eos: int, tokens: list[int], repeat: int) -> dict:
    import llguidance
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    t0 = time.perf_counter()
    tok = llguidance.LLTokenizer(tokenizer_json, eos_token=eos)
    setup = time.perf_counter() - t0
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    per = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        compile_s = time.perf_counter() - t0
        mask = allocate_token_bitmask(1, tok.vocab_size)
        for t in tokens:
            t0 = time.perf_counter()
            fill_next_token_bitmask(m, mask)
            per.append(time.perf_counter() - t0)
            assert (mask[0, t // 32] >> (t % 32)) & 1, f"llguidance masked a token of the instance: {t}"
            assert m.consume_token(t), m.get_error()
    return dict(library="llguidance", setup_s=setup, compile_s=compile_s, **_stats(per))


def outlines_cost(tokenizer_json: str, eos: int, tokens: list[int], repeat: int) -> dict:
    import outlines_core
    from tokenizers import Tokenizer

    hf = Tokenizer.from_str(tokenizer_json)
    t0 = time.perf_counter()
    vocab: dict[bytes, list[int]] = {}
    for i in range(hf.get_vocab_size()):
        if i == eos:
            continue
        text = hf.decode([i], skip_special_tokens=False)
        if "\ufffd" in text:  # a partial UTF-8 byte: keep its raw byte
            text = hf.id_to_token(i)
        vocab.setdefault(text.encode(), []).append(i)
    voc = outlines_core.Vocabulary(eos, vocab)
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
    index = outlines_core.Index(regex, voc)
    setup = time.perf_counter() - t0
    size = hf.get_vocab_size()
    per = []
    for _ in range(repeat):
        guide = outlines_core.Guide(index)
        mask = np.zeros((size + 31) // 32, dtype=np.int32)
        for t in tokens:
            t0 = time.perf_counter()
            guide.write_mask_into(mask.ctypes.data, mask.size, 4)
            per.append(time.perf_counter() - t0)
            guide.advance(t)
    return dict(library="outlines-core", setup_s=setup, compile_s=setup, **_stats(per))


def _stats(per: list[float]) -> dict:
    us = sorted(x * 1e6 for x in per)
    return dict(tokens=len(per), mean_us=statistics.fmean(us), median_us=us[len(us) // 2],
                p95_us=us[int(0.95 * (len(us) - 1))], max_us=us[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True, help="a tokenizer.json")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--eos", default="<|endoftext|>", help="the EOS token's text")
    args = ap.parse_args(argv)
    from tokenizers import Tokenizer

    text = open(args.tokenizer).read()
    hf = Tokenizer.from_str(text)
    eos = hf.token_to_id(args.eos)
    tokens = hf.encode(json.dumps(INSTANCE)).ids
    print(f"vocabulary {hf.get_vocab_size()} tokens; instance {len(tokens)} tokens")
    for fn in (llguidance_cost, outlines_cost):
        try:
            r = fn(text, eos, tokens, args.repeat)
        except ImportError as e:
            print(f"{fn.__name__}: not installed ({e})")
            continue
        print(f"{r['library']}: setup {r['setup_s']:.2f} s, grammar {r['compile_s'] * 1e3:.1f} ms; mask per token "
              f"mean {r['mean_us']:.0f} us, median {r['median_us']:.0f}, p95 {r['p95_us']:.0f}, max {r['max_us']:.0f}")


if __name__ == "__main__":
    main()

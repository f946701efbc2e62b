"""Structured outputs in jobs: the job's constraint (--json-schema, --regex,
--choices), rows' own (response_format, json_schema, regex, choices), OpenAI
batch bodies' response_format; bad constraints are error rows or one
configuration error naming the problem."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import datasets
import pytest

from jobs.cli import build_parser, config_from_args
from jobs.config import ConfigError
from jobs.output import FingerprintMismatch
from jobs.runner import run_job
from mtp_engine import MTPEngine
from tests.jobs.conftest import job_config, write_jsonl
from tests.mtp_engine.test_constraints import SCHEMA, valid

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "models" / "qwen3-next-tiny-stdlib"
PROMPTS = ["def add(a, b):", "import os\n", "class Point:", "# the record of a parser\n", "def main():",
           "x = ", "# tags of the json module\n", "print(", "from typing import Any\n", "def close(self):"]


@pytest.fixture(scope="module")
def shipped():
    return MTPEngine.load(SHIPPED, dtype="float32")


def rows_by_id(folder) -> dict:
    return {r["id"]: r for r in datasets.load_from_disk(str(folder))}


@pytest.mark.parametrize("mode", ["auto", "tree"])
def test_a_json_schema_job_writes_rows_that_parse_and_validate(tmp_path, shipped, mode):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    rows = [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)]
    rows += [
        {"id": "regex", "prompt": "x = ", "regex": r"[0-9]{1,4}"},
        {"id": "choices", "prompt": "answer:", "choices": ["yes", "no"]},
        {"id": "format", "prompt": "config = ", "response_format": {"type": "json_object"}, "max_tokens": 48},
        {"id": "text", "prompt": "def f():", "response_format": {"type": "text"}, "max_tokens": 8},
        {"id": "bad-regex", "prompt": "x", "regex": "(unclosed"},
        {"id": "bad-schema", "prompt": "x", "json_schema": {"type": "nonsense"}},
        {"id": "two", "prompt": "x", "regex": "a", "choices": ["a"]},
    ]
    out = tmp_path / "out"
    summary = run_job(job_config(write_jsonl(tmp_path / "in.jsonl", rows), SHIPPED, out, json_schema=str(schema),
                                 max_tokens=96, mode=mode, draft_tokens=3, batch_size=8, temperature=0.7),
                      engine=shipped)
    got = rows_by_id(out)
    assert len(got) == len(rows)
    for i in range(len(PROMPTS)):
        r = got[f"p{i}"]
        if r["finish_reason"] == "length":  # cut by max_tokens, and it says so
            assert r["error"].startswith("constraint_incomplete: max_tokens (96) ended the output"), r
            continue
        assert r["finish_reason"] == "stop" and r["error"] is None
        assert valid(json.loads(r["completion"]), SCHEMA), r["completion"]
    assert sum(got[f"p{i}"]["finish_reason"] == "stop" for i in range(len(PROMPTS))) >= len(PROMPTS) - 1
    assert re.fullmatch(r"[0-9]{1,4}", got["regex"]["completion"])
    assert got["choices"]["completion"] in ("yes", "no") and got["choices"]["finish_reason"] == "stop"
    assert got["format"]["error"] or isinstance(json.loads(got["format"]["completion"]), dict)
    assert got["text"]["error"] is None and not got["text"]["completion"].startswith("{")  # the row asked for none
    assert got["bad-regex"]["error"].startswith("invalid_constraint: invalid regex")
    assert got["bad-schema"]["error"].startswith("invalid_constraint: invalid json_schema")
    assert got["two"]["error"] == ("invalid_constraint: set one of response_format, json_schema, regex, choices, "
                                   "not regex and choices")
    assert summary.errors == 3  # the incomplete rows are not error rows


def test_openai_batch_response_format_is_honoured(tmp_path, shipped):
    def line(cid, response_format):
        return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
                "body": {"prompt": "def area(r):", "max_tokens": 64, "response_format": response_format}}

    lines = [line("schema", {"type": "json_schema", "json_schema": {"name": "rec", "schema": SCHEMA}}),
             line("object", {"type": "json_object"}), line("bad", {"type": "yaml"})]
    out, log = tmp_path / "out", io.StringIO()
    run_job(job_config(write_jsonl(tmp_path / "batch.jsonl", lines), SHIPPED, out, batch_size=4),
            engine=shipped, stream=log)
    assert "response_format" not in log.getvalue()  # not named as a field the runner ignores
    got = rows_by_id(out)
    assert got["schema"]["finish_reason"] == "stop" and valid(json.loads(got["schema"]["completion"]), SCHEMA)
    assert got["object"]["error"] or isinstance(json.loads(got["object"]["completion"]), dict)
    assert got["bad"]["error"] == ("invalid_constraint: response_format type must be text, json_object or "
                                   "json_schema, got 'yaml'")


def parse(*argv):
    return config_from_args(build_parser().parse_args(["generate", "--dataset", "d", "--model", "m", "--output",
                                                       "o", *argv]))


def test_the_constraint_flags_are_checked_and_fingerprinted(tmp_path, job_model, job_engine):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    assert parse("--choices", "yes, no").choices == ("yes", "no")
    assert parse("--choices", '["a, b", "c"]').constraint().value == ("a, b", "c")
    assert parse("--json-schema", str(schema)).constraint().kind == "json_schema"
    with pytest.raises(ConfigError, match="missing.json' cannot be read"):
        parse("--json-schema", str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "object", "properties": {"a": {"type": "nonsense"}}}')
    with pytest.raises(ConfigError, match="invalid json_schema"):
        parse("--json-schema", str(bad))
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        parse("--json-schema", str(bad))
    with pytest.raises(ConfigError, match="invalid regex"):
        parse("--regex", "[a-")
    with pytest.raises(ConfigError, match="not regex and choices"):
        parse("--regex", "a+", "--choices", "a")
    assert parse("--regex", "a+", "--mode", "tree").constraint().kind == "regex"  # every mode takes one

    dataset = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}])
    out = tmp_path / "out"
    run_job(job_config(dataset, job_model, out, regex="[a-z]{1,3}", max_tokens=4), engine=job_engine)
    assert re.fullmatch("[a-z]{1,3}", rows_by_id(out)["a"]["completion"])
    with pytest.raises(FingerprintMismatch, match="constraint"):
        run_job(job_config(dataset, job_model, out, regex="[0-9]{1,3}", max_tokens=4), engine=job_engine)

"""`python -m jobs audit`: a job folder's rows against plain decoding of the
job's own dataset and settings."""

from __future__ import annotations

import io

import mlx.core as mx
import pytest

from jobs.audit import audit_folder, audit_row
from jobs.cli import main
from jobs.prompts import Request
from jobs.runner import run_job
from mtp_engine import MTPEngine
from mtp_engine.io.tiny import make_tiny_checkpoint, tiny_config
from mtp_engine.tools.lossless import engine_tops, near_tie_bound
from tests.jobs.conftest import job_config, prompt_rows, write_jsonl


def job(tmp_path, job_model, job_engine, **overrides):
    data = write_jsonl(tmp_path / "prompts.jsonl", prompt_rows(6))
    out = tmp_path / "out"
    run_job(job_config(data, job_model, out, batch_size=3, **overrides), engine=job_engine, stream=io.StringIO())
    return out


@pytest.mark.parametrize("overrides", [dict(mode="chain"), dict(mode="auto", temperature=0.8, n=2, seed=3),
                                       dict(mode="chain", temperature=0.8, sampler="rejection")])
def test_a_jobs_rows_are_plain_decodings_own(tmp_path, job_model, job_engine, overrides):
    out = job(tmp_path, job_model, job_engine, **overrides)
    lines = []
    report = audit_folder(out, engine=job_engine, log=lines.append)
    rows = 6 * overrides.get("n", 1)
    assert report.rows == rows and len(report.audited) == rows and len(lines) == rows
    if overrides.get("sampler") == "rejection":  # its tokens depend on K by design
        assert report.count("not auditable") == rows
    else:
        assert report.count("identical") == rows, lines


def test_rows_another_model_wrote_are_flagged_and_the_command_exits_1(tmp_path, job_model, job_engine, capsys):
    out = job(tmp_path, job_model, job_engine, mode="chain")
    other = MTPEngine.load(make_tiny_checkpoint(tmp_path / "other", tiny_config(), seed=9, predictability=0.4))
    report = audit_folder(out, sample=3, seed=1, engine=other, log=lambda line: None)
    assert len(report.audited) == 3 and report.count("diverged") == 3
    assert all(a.position is not None for a in report.audited)
    # The command: a sample of the folder against the job's own model.
    assert main(["audit", str(out), "--sample", "4"]) == 0
    printed = capsys.readouterr().out
    assert printed.count(": identical") == 4 and "audited 4 of 6 completed rows: 4 identical" in printed


def test_a_folder_whose_dataset_changed_is_refused(tmp_path, job_model, job_engine, capsys):
    out = job(tmp_path, job_model, job_engine, mode="chain")
    write_jsonl(tmp_path / "prompts.jsonl", prompt_rows(7))
    assert main(["audit", str(out)]) == 1
    assert "is not the dataset" in capsys.readouterr().err
    assert main(["audit", str(tmp_path / "nothing-here")]) == 1
    assert main(["audit", str(out), "--sample", "0"]) == 2


def test_a_divergence_on_a_near_tie_is_told_from_a_real_one(job_engine):
    # Judged at bfloat16's bound (this CPU runs the MoE model in float32
    # only), the tiny model has positions where its top two logits sit within
    # a few units of the last place: a row that took the runner-up there
    # parted at a near-tie; one that took it at a wide gap diverged.
    engine, dtype = job_engine, mx.bfloat16
    for text in ["def add(a, b):", "Hello, world!", "class Point:", "The quick brown fox", "import os"]:
        ids = engine.encode(text)
        plain = engine.generate(ids, mode="baseline", max_tokens=48, trace=True)
        tops = engine_tops(plain.trace)
        gaps = [(i, t[0][1] - t[1][1], near_tie_bound(t[0][1], dtype, 4.0)) for i, t in enumerate(tops)
                if t is not None and i < len(plain.tokens)]
        close = next(((i, b) for i, g, b in gaps if g < b), None)
        wide = next(((i, b) for i, g, b in gaps if g > 4 * b), None)
        if close and wide:
            break
    else:
        pytest.skip("no near-tie in these decodings")
    req = Request("r", 0, None, "", ids, 48, ())
    for (i, bound), verdict in ((close, "near-tie"), (wide, "diverged")):
        runner_up = tops[i][1][0]
        stored = engine.tokenizer.decode(plain.tokens[:i] + [runner_up])
        for row in ({"completion": stored}, {"completion": stored, "token_ids": plain.tokens[:i] + [runner_up]}):
            result = audit_row(engine, req, {"id": "r", "sample": 0, **row}, dtype)  # by text, then by ids
            assert (result.verdict, result.position, result.rank) == (verdict, i, 2)
            assert result.gap == pytest.approx(tops[i][0][1] - tops[i][1][1]) and result.bound == pytest.approx(bound)


def test_token_ids_place_the_parting_where_the_text_cannot(job_engine):
    # The stored row spelled one of plain decoding's tokens as two tokens of
    # the same characters, went on as plain decoding did, then parted: by its
    # text the audit finds the parting only where the characters differ; by
    # its ids (a job run with --logprobs keeps them) at the split itself.
    engine = job_engine
    decode = engine.tokenizer.decode
    pieces = {decode([t]): t for t in range(engine.text.args.vocab_size) if decode([t]).isascii()}
    for text in ["def add(a, b):", "Hello, world!", "class Point:", "The quick brown fox", "import os"]:
        ids = engine.encode(text)
        plain = engine.generate(ids, mode="baseline", max_tokens=48, trace=True)
        split = next(((i, pieces[w[:c]], pieces[w[c:]]) for i, t in enumerate(plain.tokens[:30])
                      if (w := decode([t])).isascii() for c in range(1, len(w))
                      if w[:c] in pieces and w[c:] in pieces), None)
        if split:
            break
    else:
        pytest.skip("no token of these decodings is two others")
    i, first, second = split
    later = plain.tokens[i + 1 : i + 4]
    other = next(t for t in pieces.values() if not decode(plain.tokens[: i + 4] + [t]).startswith(
        decode(plain.tokens[: i + 5])))
    stored = plain.tokens[:i] + [first, second] + later + [other]
    req = Request("r", 0, None, "", ids, 48, ())
    row = {"id": "r", "sample": 0, "completion": decode(stored)}
    by_text = audit_row(engine, req, row, mx.float32)
    by_ids = audit_row(engine, req, {**row, "token_ids": stored}, mx.float32)
    assert by_ids.verdict == "diverged" and by_ids.position == i
    assert by_text.verdict == "diverged" and by_text.position > i


def test_a_row_plain_batching_gives_is_not_a_divergence(tmp_path, job_model, job_engine, monkeypatch, capsys):
    # In bfloat16 on a GPU plain batching can part from one-row decoding by
    # more than a near-tie; this CPU runs the MoE model in float32 only, where
    # the two agree, so the one-row check is made to fail here and the
    # re-check (plain batching at the job's batch size, run for real) decides.
    import jobs.audit as audit

    out = job(tmp_path, job_model, job_engine, mode="chain")
    monkeypatch.setattr(audit, "audit_row", lambda engine, req, row, dtype: audit.RowAudit(
        row["id"], row["sample"], "diverged", position=0, note="made to fail"))
    report = audit_folder(out, engine=job_engine, log=lambda line: None)
    assert report.count("batched") == 6 and report.count("diverged") == 0
    assert all("plain batching at B=3 gives it" in a.note for a in report.audited)
    assert audit.run_audit(out, None, 0, None) == 0
    assert "6 as plain batching gives them, 0 exact in float32 (half-precision arithmetic), 0 diverged" in \
        capsys.readouterr().out


def test_a_half_precision_divergence_the_mode_decodes_exactly_in_float32_is_told_apart(tmp_path, job_model,
                                                                                      job_engine):
    # A bfloat16 row parted from plain decoding past the near-tie bound (made
    # here: plain decoding's runner-up at a wide gap, judged at bfloat16's
    # bound) is re-decoded in the job's own mode and batch size in float32
    # (this CPU's model, run for real); where that equals plain decoding the
    # row is "precision". A stored token outside plain decoding's top two
    # stays "diverged".
    from jobs.audit import _requests, recheck_in_float32
    from jobs.config import JobConfig
    from jobs.output import read_manifest
    from jobs.readers import PromptSource

    out = job(tmp_path, job_model, job_engine, mode="chain", draft_tokens=3)
    config = JobConfig.from_sources(read_manifest(out)["config"], {}).resolved()
    requests = _requests(config, job_engine, PromptSource(config.dataset), {f"row-{i}" for i in range(6)}, 2)
    rows, audits = [], []
    for rid, req in sorted(requests.items())[:4]:
        plain = job_engine.generate(req.prompt_ids, mode="baseline", max_tokens=req.max_tokens, trace=True)
        tops = engine_tops(plain.trace)
        i = next(i for i, t in enumerate(tops) if t is not None and i < len(plain.tokens)
                 and t[0][1] - t[1][1] > 4 * near_tie_bound(t[0][1], mx.bfloat16, 4.0))
        pick = tops[i][1][0] if len(rows) % 2 == 0 else tops[i][3][0]  # runner-up, or fourth
        row = {"id": rid, "sample": 0, "completion": job_engine.tokenizer.decode(plain.tokens[:i] + [pick])}
        audit = audit_row(job_engine, req, row, mx.bfloat16)
        assert (audit.verdict, audit.rank) == ("diverged", 2 if len(rows) % 2 == 0 else 4)
        rows.append(row)
        audits.append(audit)
    lines = []
    recheck_in_float32(job_engine, config, requests, rows, audits, log=lines.append)
    assert [a.verdict for a in audits] == ["precision", "diverged"] * 2 and len(lines) == 2
    assert all("in float32 chain at B=3 decodes it as plain decoding does" in a.note for a in audits[::2])

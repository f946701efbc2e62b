"""``python -m jobs audit DIR``: check a job folder's rows against plain
decoding, the lossless contract on the user's own data.

A sample of the folder's completed rows (all of them by default) is decoded
again with plain decoding (no drafts, a batch of one) from the job's own
dataset and settings (the manifest's), and each row is reported as

- **identical**: the stored completion is plain decoding's text;
- **near-tie**: greedy, and the first token where they part is one plain
  decoding's logits rank within a numerical near-tie of its own choice
  (top-2 gap under the bound of `mtp_engine.tools.lossless`: 1e-4 in
  float32, 4 units in the last place of the top logit in bfloat16 or
  float16). A verify forward over several tokens and a one-token forward
  add in different orders, so on such a tie they may choose differently;
- **batched**: not plain decoding's text, but plain *batching*'s: the row
  decoded again without drafts among the sample's other rows, at the job's
  batch size, gives the stored completion. In bfloat16 on a GPU a batch
  computes some products with other kernels and reduction orders than one
  row does (a flipped MoE route upstream can move the logits well past a
  near-tie), so plain batching parts from one-row decoding on its own; such
  a row tells nothing against speculation (in float32 the two agree: the
  test suite checks plain batching against one-row decoding);
- **precision**: in bfloat16 or float16, a row still parted from both
  where the model loaded in float32 decodes it in the job's own mode
  (drafts, batch size) exactly as plain decoding in float32 does (the
  speculation is exact on this row), and the stored token where it parts
  is plain decoding's runner-up there: a verify forward over several
  tokens or paths rounds its half-precision products otherwise than a
  one-token forward, and an MoE route flipped upstream moves the logits
  past the near-tie bound (the float32 model takes twice the weights'
  memory);
- **diverged**: anything else (exit status 1), including a sampled row that
  neither plain decoding nor plain batching gives (the exact sampler's
  draw is not classified further);
- **not auditable**: rows of the rejection sampler, whose tokens depend on
  the draft depth by design.

Where they part is found from the token ids where the folder has them (a
job run with ``--logprobs``), else from the text: the first of plain
decoding's tokens whose text the stored completion does not continue. Text
alone can place it late, where two tokenizations of the same characters
(one whitespace token or two) meet a later token that tells them apart;
there the stored token may not be among plain decoding's top 4.
"""

from __future__ import annotations

import random
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import datasets
import mlx.core as mx
import orjson

from jobs.config import JobConfig
from jobs.output import OutputError, read_manifest
from jobs.prompts import Preparer, Request
from jobs.readers import PromptSource
from jobs.runner import scan_dataset
from mtp_engine import MTPEngine
from mtp_engine.backend import exact_float32
from mtp_engine.decoder import Decoder
from mtp_engine.modes import DecodeConfig
from mtp_engine.sampling import top_logits
from mtp_engine.tools.lossless import engine_tops, near_tie_bound

HALF_ULPS = 4.0
"""The near-tie bound in bfloat16 / float16, in units of the top logit's
last place (as `python -m mtp_engine.lossless` defaults to)."""


@dataclass
class RowAudit:
    """One audited row: its verdict and, where it parts from plain decoding,
    the token position and plain decoding's top-2 gap there."""

    id: str
    sample: int
    verdict: str  # identical | near-tie | batched | precision | diverged | not auditable
    position: int | None = None
    gap: float | None = None
    bound: float | None = None
    rank: int | None = None  # the stored token's rank in plain decoding's logits there (1 = its own choice)
    note: str = ""

    def line(self) -> str:
        where = f" at token {self.position}" if self.position is not None else ""
        gap = (f" (plain decoding's lead there {self.gap:.4g}, near-tie bound {self.bound:.4g})"
               if self.gap is not None else "")
        return f"{self.id}#{self.sample}: {self.verdict}{where}{gap}{'; ' + self.note if self.note else ''}"


@dataclass
class AuditReport:
    rows: int = 0  # completed rows in the folder
    audited: list[RowAudit] = field(default_factory=list)

    def count(self, verdict: str) -> int:
        return sum(a.verdict == verdict for a in self.audited)

    def summary(self) -> str:
        return (f"audited {len(self.audited)} of {self.rows} completed rows: {self.count('identical')} identical, "
                f"{self.count('near-tie')} parted at a numerical near-tie, {self.count('batched')} as plain batching "
                f"gives them, {self.count('precision')} exact in float32 (half-precision arithmetic), "
                f"{self.count('diverged')} diverged, "
                f"{self.count('not auditable')} not auditable")


def audit_folder(folder: Path, sample: int | None = None, seed: int = 0, dataset: str | None = None,
                 engine: MTPEngine | None = None, wide_engine: MTPEngine | None = None, log=print) -> AuditReport:
    """Audit ``sample`` rows (all when None) of a job folder, drawn with
    ``seed``; ``dataset`` replaces the manifest's path to the job's dataset
    (a folder read from another directory); ``log`` gets one line per row.
    ``engine`` and ``wide_engine`` (the model in float32, for the precision
    re-check) are loaded from the manifest's model when not given.

    Raises:
        OutputError: Not a job folder, or its dataset is not the one the
            rows came from.
    """
    manifest = read_manifest(folder)
    config = JobConfig.from_sources(manifest.get("config") or {}, {"dataset": dataset}).resolved()
    source = PromptSource(config.dataset)
    if source.identity() != (manifest.get("dataset") or {}).get("identity"):
        raise OutputError(f"{config.dataset} is not the dataset {folder}'s rows came from (it changed, or another "
                          "path was given); the audit re-reads the prompts, so it needs the job's own dataset")
    try:
        table = datasets.load_from_disk(str(folder))
    except (FileNotFoundError, ValueError) as e:
        raise OutputError(f"{folder} has no readable rows ({e}); run `python -m jobs status {folder}`") from None
    columns = ["id", "sample", "completion", "finish_reason"]
    columns += ["token_ids"] if "token_ids" in table.column_names else []
    done = [r for r in table.select_columns(columns).to_list() if r["finish_reason"] != "error"]
    rows = done
    if sample is not None and sample < len(done):  # a sample, in the folder's order
        rows = [done[i] for i in sorted(random.Random(seed).sample(range(len(done)), sample))]
    report = AuditReport(rows=len(done))
    engine = engine or MTPEngine.load((manifest.get("model") or {}).get("path") or config.model,
                                      options=config.engine_options())
    requests = _requests(config, engine, source, {r["id"] for r in rows}, manifest.get("schema_version") or 1)
    dtype = engine.model(mx.array([[0]])).dtype  # the precision the logits are computed in
    lines = []
    for row in rows:
        req = requests.get(row["id"])
        result = (RowAudit(row["id"], row["sample"], "diverged", note="the dataset no longer gives this row")
                  if req is None else audit_row(engine, req, row, dtype))
        report.audited.append(result)
        lines.append(row)
        log(result.line())
    recheck = [i for i, a in enumerate(report.audited) if a.verdict == "diverged" and lines[i]["id"] in requests]
    if recheck and config.batch_size > 1:
        batched = decode_rows(engine, requests, [lines[i] for i in recheck], lines,
                              DecodeConfig(mode="baseline", batch_size=config.batch_size))
        for i, text in zip(recheck, batched):
            if text == (lines[i]["completion"] or ""):
                a = report.audited[i]
                a.verdict, a.note = "batched", f"plain batching at B={config.batch_size} gives it"
                log("re-checked: " + a.line())
    if dtype != mx.float32 and _runners_up(report.audited, lines, requests):
        wide = wide_engine or MTPEngine.load((manifest.get("model") or {}).get("path") or config.model,
                                             dtype="float32", options=config.engine_options())
        recheck_in_float32(wide, config, requests, lines, report.audited, log)
    return report


def _runners_up(audits: list[RowAudit], rows: list[dict], requests: dict[str, Request]) -> list[int]:
    """The "diverged" rows whose stored token is plain decoding's runner-up
    where they part (the precision re-check's rows)."""
    return [i for i, a in enumerate(audits) if a.verdict == "diverged" and a.rank == 2 and rows[i]["id"] in requests]


def recheck_in_float32(wide: MTPEngine, config: JobConfig, requests: dict[str, Request], rows: list[dict],
                       audits: list[RowAudit], log=print) -> None:
    """Turn each of `_runners_up` (half-precision rows) into "precision"
    when ``wide`` (the model in float32) decodes the row in the job's own
    mode and batch size as plain decoding in float32 does (up to a float32
    near-tie)."""
    recheck = _runners_up(audits, rows, requests)
    if not recheck:
        return
    # the MLX head drafts: it runs on every backend and dtype, and a drafter changes speed, never tokens
    exact = decode_rows(wide, requests, [rows[i] for i in recheck], rows, replace(config.decode_config(), drafter="mlx"))
    for i, text in zip(recheck, exact):
        row, a = rows[i], audits[i]
        row = {**row, "completion": text, "token_ids": None}  # the float32 decoding's text, not the stored ids
        check = audit_row(wide, requests[row["id"]], row, mx.float32)
        if check.verdict in ("identical", "near-tie"):
            a.verdict = "precision"
            a.note = (f"in float32 {config.mode} at B={config.batch_size} decodes it as plain decoding does"
                      f"{' up to a near-tie' if check.verdict == 'near-tie' else ''}; the stored token is plain "
                      "decoding's runner-up")
        else:
            a.note = f"in float32 too: {check.line()}"
        log("re-checked in float32: " + a.line())


def decode_rows(engine: MTPEngine, requests: dict[str, Request], rows: list[dict], others: list[dict],
                decode: DecodeConfig) -> list[str]:
    """The text ``decode`` gives each of ``rows`` (plain batching, or the
    job's own mode), ``decode.batch_size`` rows at a time, with enough of
    ``others`` (the sample's other rows, decoded alike and not returned)
    that they start among as many rows as in the job."""
    fill = [r for r in others if r not in rows]
    order = list(rows) + fill[: max(0, decode.batch_size - len(rows))]
    decoder = Decoder(engine, decode)
    for n, row in enumerate(order):
        req = requests[row["id"]]
        decoder.add(n, req.prompt_ids, [req.sample_params(row["sample"])], max_tokens=req.max_tokens,
                    stop=list(req.stop) or None)
    results = {}
    while decoder.pending:
        results.update(decoder.step())
    return [results[(n, 0)].text for n in range(len(rows))]


def _requests(config: JobConfig, engine: MTPEngine, source: PromptSource, wanted: set[str],
              schema_version: int) -> dict[str, Request]:
    """The job's requests for these ids, prepared as the job prepared them
    (ids claimed in dataset order, so made-up ids of duplicates match)."""
    preparer = Preparer(config, engine.tokenizer, engine.context_length, reserved_ids=scan_dataset(source, config).ids,
                        sampling_allowed=schema_version >= 2)
    found = {}
    for row in source:
        if config.limit is not None and row.index >= config.limit:
            break
        rid, error = preparer.claim_id(row)
        if error is None and rid in wanted:
            item = preparer.prepare(row, rid)
            if isinstance(item, Request):
                found[rid] = item
    return found


def audit_row(engine: MTPEngine, req: Request, row: dict, dtype) -> RowAudit:
    """One stored row against plain decoding of its request (by its token
    ids where it keeps them, else by its text)."""
    params = req.sample_params(row["sample"])
    rid, j = row["id"], row["sample"]
    if params.rejects:
        return RowAudit(rid, j, "not auditable", note="the rejection sampler's tokens depend on the draft depth")
    plain = engine.generate(req.prompt_ids, decode=DecodeConfig(mode="baseline"), sampling=params,
                            max_tokens=req.max_tokens, stop=list(req.stop) or None, trace=True)
    stored = row["completion"] or ""
    if plain.text == stored:
        return RowAudit(rid, j, "identical")
    tokens, ids = plain.tokens, row.get("token_ids")
    text = lambda seq: engine.tokenizer.decode(seq)  # noqa: E731
    fits = lambda s: stored.startswith(s) or s.startswith(stored)  # noqa: E731  (one ends where the other goes on)
    if ids is not None:  # the first id that differs
        i = next((i for i, (a, b) in enumerate(zip(tokens, ids)) if a != b), min(len(tokens), len(ids)))
    else:  # the first of plain decoding's tokens the stored text does not continue
        i = next((i for i in range(len(tokens)) if not fits(text(tokens[: i + 1]))), len(tokens))
    if not params.greedy or i == len(tokens) or ids is not None and i == len(ids):
        note = ("sampled rows are not classified" if not params.greedy else
                "plain decoding ended first" if i == len(tokens) else "the stored row ended first")
        return RowAudit(rid, j, "diverged", position=i, note=note)
    tops = engine_tops(plain.trace)
    here = tops[i] if i < len(tops) and tops[i] is not None else _first_tops(engine, req.prompt_ids)
    mine = dict(here)
    if ids is not None:
        other = ids[i] if ids[i] in mine else None
    else:  # a token of plain decoding's top 4 that the stored text continues
        other = next((t for t, _ in here if t != tokens[i] and fits(text(tokens[:i] + [t]))), None)
    bound = near_tie_bound(here[0][1], dtype, HALF_ULPS)
    if other is None:
        return RowAudit(rid, j, "diverged", position=i, bound=bound,
                        note="the stored token is not among plain decoding's top 4 there")
    gap = mine[tokens[i]] - mine[other]
    rank = 1 + [t for t, _ in here].index(other)
    return RowAudit(rid, j, "near-tie" if gap < bound else "diverged", position=i, gap=gap, bound=bound, rank=rank)


def _first_tops(engine: MTPEngine, prompt: list[int]) -> list[tuple[int, float]]:
    """Plain decoding's top logits at the first generated position (the
    prompt's forward, which a trace does not record)."""
    return top_logits(engine.model(mx.array([prompt]))[0, -1:])[0]


def run_audit(folder: Path, sample: int | None, seed: int, dataset: str | None, json_path: str | None = None,
              stream=None) -> int:
    """The ``audit`` command: 0 when no row diverged for real, else 1
    (``json_path``: the report as JSON too)."""
    stream = stream or sys.stdout
    exact_float32()  # the float32 re-check, on CUDA
    if sample is not None and sample < 1:
        print(f"error: --sample must be at least 1, got {sample}", file=sys.stderr)
        return 2
    try:
        report = audit_folder(folder, sample, seed, dataset, log=lambda line: print(line, file=stream, flush=True))
    except (OutputError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(report.summary(), file=stream)
    if json_path:
        Path(json_path).write_bytes(orjson.dumps({"folder": str(folder), "rows": report.rows, "summary": report.summary(),
                                                  "audited": [asdict(a) for a in report.audited]},
                                                 option=orjson.OPT_INDENT_2))
    return 1 if report.count("diverged") else 0

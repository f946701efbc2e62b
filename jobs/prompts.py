"""Turn input rows into generation requests, or into error rows.

A row gives either a ``prompt`` string (used as is) or chat ``messages``
(rendered with the tokenizer's chat template, ``add_generation_prompt=True``).
Optional per-row fields override the job's: ``max_tokens``, ``stop``,
``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``, ``n``, the
penalties (``repetition_penalty``, ``presence_penalty``,
``frequency_penalty``), ``logprobs`` and a constraint on the output
(``response_format``, ``json_schema``, ``regex`` or ``choices``:
`mtp_engine.constraints`; a bad one is an ``invalid_constraint`` error row). A line
of an OpenAI batch file is read as such a row (`jobs.openai_batch`). Every
problem becomes one error row with a kind and a message; nothing here
raises for bad input, except a chat template that runs past
``RENDER_LIMIT_S`` on each of the first ``STUCK_ROWS`` chat rows
(`TemplateStuck`: the template loops, and every row would wait).
"""

from __future__ import annotations

import hashlib
import signal
import threading
from dataclasses import dataclass, field, replace

import orjson

from jobs import openai_batch
from jobs.config import MAX_N, JobConfig
from jobs.readers import SourceRow
from mtp_engine.constraints import Constraint, ConstraintError, from_fields, validate
from mtp_engine.sampling import SamplingParams, check_logprobs
from mtp_engine.stopping import check_max_tokens

SAMPLING_OVERRIDES = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
                      "frequency_penalty")
RENDER_LIMIT_S = 10.0
"""Seconds a chat template may take to render one row (a real one takes
milliseconds); a row past it is an error row ``template_timeout``."""
STUCK_ROWS = 3
"""Chat rows that time out, with none rendered before them, after which the
job stops (`TemplateStuck`) instead of waiting on every row."""


class TemplateStuck(Exception):
    """The chat template runs past the time limit on every row tried."""


class _RenderTimeout(Exception):
    pass


def _within(seconds: float, fn):
    """``fn()``, interrupted after ``seconds`` by SIGALRM (`_RenderTimeout`);
    without a limit off the main thread, where no signal can reach it."""
    if threading.current_thread() is not threading.main_thread():
        return fn()

    def expire(signum, frame):
        raise _RenderTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def raw_id(data: dict | None, id_field: str):
    """The id a row gives itself (an OpenAI batch line: its custom_id)."""
    data = data or {}
    return data.get("custom_id") if openai_batch.is_request(data) else data.get(id_field)


def completion_seed(seed: int, row_id: str, sample: int) -> int:
    """The seed of completion ``sample`` of row ``row_id``: a hash of the
    job's (or the row's) seed, the id and the sample index, so reruns,
    resumes and any number of ranks sample the same tokens."""
    digest = hashlib.sha256(f"{seed}\0{row_id}\0{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


@dataclass(frozen=True)
class Request:
    """A row ready to generate."""

    id: str
    index: int
    line: int | None
    prompt: str
    prompt_ids: list[int]
    max_tokens: int
    stop: tuple[str, ...]
    sampling: SamplingParams = SamplingParams()
    n: int = 1
    chat: bool = False
    kept: dict = field(default_factory=dict)
    logprobs: int | None = None
    constraint: Constraint | None = None

    def seed(self, sample: int) -> int:
        """Completion ``sample``'s derived seed (`completion_seed`)."""
        return completion_seed(self.sampling.seed, self.id, sample)

    def sample_params(self, sample: int) -> SamplingParams:
        """Sampling of completion ``sample`` (its own derived seed)."""
        if self.sampling.greedy:
            return self.sampling
        return replace(self.sampling, seed=self.seed(sample))


@dataclass(frozen=True)
class RowError:
    """A row that yields an error row."""

    id: str
    index: int
    line: int | None
    kind: str
    message: str
    prompt: str | None = None
    chat: bool | None = None
    kept: dict = field(default_factory=dict)


def kept_value(value) -> str | None:
    """An input column's value as the output keeps it: text as is, any other
    value as its JSON text (a column may mix types across rows)."""
    if value is None or isinstance(value, str):
        return value
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()


class Preparer:
    """Renders rows for one job; remembers ids to refuse duplicates.

    Args:
        config: The job's configuration.
        tokenizer: mlx-lm ``TokenizerWrapper`` of the model.
        context_length: The model's context, in tokens.
        reserved_ids: Every id the dataset gives itself; an id made for a
            duplicate never takes one of them.
        sampling_allowed: False for folders of output schema 1 (no sample
            or seed columns): rows that sample become error rows.
        log: Where notes go (OpenAI batch fields not honoured, once each).
        keep_columns: Input columns each output row carries (`kept_value`).
        logprob_columns: Whether the output has log-probability columns
            (rows then get the job's or their own ``logprobs``).
    """

    def __init__(self, config: JobConfig, tokenizer, context_length: int, reserved_ids: set[str] = frozenset(),
                 sampling_allowed: bool = True, log=None, keep_columns: tuple[str, ...] = (),
                 logprob_columns: bool = False):
        self.config = config
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.reserved = set(reserved_ids)
        self.seen: set[str] = set()
        self.sampling_allowed = sampling_allowed
        self.unknown = openai_batch.UnknownFields(log)
        self.keep_columns = keep_columns
        self.logprob_columns = logprob_columns
        self.checked: dict[Constraint, str | None] = {}  # each constraint's problem, once
        self.rendered = 0  # chat rows rendered in time
        self.timeouts = 0
        self.template_options = dict(config.chat_template_kwargs or {})
        template = config.template_text()
        if template is not None:
            self.template_options["chat_template"] = template

    def row_id(self, row: SourceRow) -> tuple[str, str | None]:
        """The row's id and, if it is unusable, why."""
        raw = raw_id(row.data, self.config.id_field)
        field = "custom_id" if openai_batch.is_request(row.data) else self.config.id_field
        if raw is None:
            return str(row.index), None
        if isinstance(raw, bool) or not isinstance(raw, (str, int)):
            return str(row.index), f"id field {field!r} holds a {type(raw).__name__}"
        return str(raw), None

    def claim_id(self, row: SourceRow) -> tuple[str, RowError | None]:
        """Register the row's id. Every row, done or not, must pass here in
        dataset order, so duplicate handling is the same on every run."""
        rid, problem = self.row_id(row)
        if problem is None and rid in self.seen:
            dup = f"{rid}#dup-row-{row.index}"
            n = 1
            while dup in self.reserved or dup in self.seen:  # an input id of that form exists
                n += 1
                dup = f"{rid}#dup-row-{row.index}-{n}"
            self.seen.add(dup)
            return dup, self._error(row, dup, "duplicate_id", f"id {rid!r} already used by an earlier row")
        self.seen.add(rid)
        if problem is not None:
            return rid, self._error(row, rid, "invalid_id", problem)
        return rid, None

    def prepare(self, row: SourceRow, rid: str) -> Request | RowError:
        """Render and tokenize one row."""
        if row.error is not None:
            kind, _, message = row.error.partition(": ")
            return self._error(row, rid, kind, message)
        data = row.data
        cfg = self.config
        if openai_batch.is_request(data):
            try:
                data, unknown = openai_batch.request_row(data, cfg.id_field, cfg.prompt_field, cfg.messages_field)
            except ValueError as e:
                return self._error(row, rid, "invalid_request", str(e))
            self.unknown.report(unknown)
        messages = data.get(cfg.messages_field)
        chat = messages is not None
        if messages is not None:
            prompt = self._render_messages(messages)
            if isinstance(prompt, tuple):
                return self._error(row, rid, *prompt)
        else:
            if cfg.prompt_field not in data:
                return self._error(
                    row, rid, "missing_prompt",
                    f"row has neither {cfg.prompt_field!r} nor {cfg.messages_field!r}",
                )
            prompt = data[cfg.prompt_field]
            if not isinstance(prompt, str):
                return self._error(
                    row, rid, "invalid_prompt",
                    f"{cfg.prompt_field!r} must be a string, got {type(prompt).__name__}",
                )
            if not prompt.strip():
                return self._error(row, rid, "empty_prompt", f"{cfg.prompt_field!r} is empty")

        max_tokens = data.get("max_tokens", cfg.max_tokens)
        if max_tokens is None:
            max_tokens = cfg.max_tokens
        try:
            check_max_tokens(max_tokens)
        except ValueError as e:
            return self._error(row, rid, "invalid_field", str(e), prompt, chat)
        stop = data.get("stop", None)
        if stop is None:
            stop = cfg.stop
        elif isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            return self._error(row, rid, "invalid_field", f"stop must be a string or a list of non-empty strings, got {stop!r}",
                               prompt, chat)

        sampling, n = self._sampling(data)
        if isinstance(sampling, str):
            return self._error(row, rid, "invalid_field", sampling, prompt, chat)
        try:
            logprobs = check_logprobs(data.get("logprobs", self.config.logprobs))
        except ValueError as e:
            return self._error(row, rid, "invalid_field", str(e), prompt, chat)

        constraint = self._constraint(data)
        if isinstance(constraint, str):
            return self._error(row, rid, "invalid_constraint", constraint, prompt, chat)

        ids = list(self.tokenizer.encode(prompt))
        if not ids:
            return self._error(row, rid, "empty_prompt", "prompt encodes to no tokens", prompt, chat)
        if len(ids) >= self.context_length:
            return self._error(
                row, rid, "prompt_too_long",
                f"prompt has {len(ids)} tokens; the model's context is {self.context_length}",
                prompt,
            )
        return Request(rid, row.index, row.line, prompt, ids, max_tokens, tuple(stop), sampling, n, chat,
                       self._kept(row), logprobs if self.logprob_columns else None, constraint)

    def _constraint(self, data: dict) -> Constraint | None | str:
        """The row's constraint (its own fields, else the job's), or what is
        wrong with it."""
        try:
            constraint = from_fields(data)
        except ConstraintError as e:
            return str(e)
        if constraint is None:  # a row's response_format "text" asks for none
            return self.config.constraint() if data.get("response_format") is None else None
        if constraint not in self.checked:
            try:
                validate(constraint)
                self.checked[constraint] = None
            except ConstraintError as e:
                self.checked[constraint] = str(e)
        return self.checked[constraint] or constraint

    def _sampling(self, data: dict) -> tuple[SamplingParams | str, int]:
        """The row's sampling and n (the job's, with the row's overrides),
        or why they are invalid."""
        job = self.config.sampling()
        values = {name: data[name] for name in SAMPLING_OVERRIDES if data.get(name) is not None}
        try:
            sampling = replace(job, **values)
        except ValueError as e:
            return str(e), 0
        n = data.get("n")
        n = self.config.n if n is None else n
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
            return f"n must be an integer in 1..{MAX_N}, got {n!r}", 0
        if n > 1 and sampling.greedy:
            return f"n = {n} with temperature 0 would repeat one greedy completion; set a temperature above 0", 0
        if not self.sampling_allowed and (n > 1 or not sampling.greedy):
            return ("this output folder was written by an older release (output schema 1: no sample or seed "
                    "columns), which cannot hold sampled rows; write sampling jobs to a new --output"), 0
        return sampling, n

    def _render_messages(self, messages) -> str | tuple[str, str]:
        if not isinstance(messages, list) or not messages:
            return "invalid_messages", f"{self.config.messages_field!r} must be a non-empty list of messages"
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                return "invalid_messages", f"message {i} must be an object with string 'role' and 'content'"
        if self.config.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.config.system_prompt}] + messages
        try:
            text = _within(RENDER_LIMIT_S, lambda: self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **self.template_options))
        except _RenderTimeout:
            self.timeouts += 1
            if not self.rendered and self.timeouts >= STUCK_ROWS:
                raise TemplateStuck(
                    f"the model's chat template ran for more than {RENDER_LIMIT_S:g} s on each of the first "
                    f"{self.timeouts} chat rows without finishing (a loop in the template?); fix the template "
                    "(tokenizer_config.json or chat_template.jinja) or give prompts as plain text") from None
            return "template_timeout", f"chat template did not finish rendering within {RENDER_LIMIT_S:g} s"
        except Exception as e:  # jinja errors from the model's own template
            return "template_error", f"chat template failed: {e}"
        self.rendered += 1
        return text

    def _kept(self, row: SourceRow) -> dict:
        data = row.data if isinstance(row.data, dict) and not openai_batch.is_request(row.data) else {}
        return {name: kept_value(data.get(name)) for name in self.keep_columns}

    def _error(self, row: SourceRow, rid: str, kind: str, message: str, prompt: str | None = None,
               chat: bool | None = None) -> RowError:
        if row.line is not None and row.data is None and "line" not in message:
            message = f"line {row.line}: {message}"
        return RowError(rid, row.index, row.line, kind, message, prompt, chat, self._kept(row))

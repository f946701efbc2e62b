"""OpenAI batch files in and out.

In: a JSONL line ``{"custom_id", "method", "url", "body": {...}}`` of the
OpenAI Batch API is read as a row (`request_row`): ``custom_id`` is its id;
the body's ``messages`` (``/v1/chat/completions``) or ``prompt``
(``/v1/completions``), ``max_completion_tokens`` or ``max_tokens``,
``temperature``, ``top_p``, ``n``, ``seed``, ``stop``, ``presence_penalty``
and ``frequency_penalty`` become the row's fields (``top_k``, ``min_p`` and
``repetition_penalty`` too, as vLLM accepts them) and ``response_format``
(`mtp_engine.constraints`: ``json_object`` or ``json_schema``). Fields the job
cannot honour are named once in the job's log (`UnknownFields`), never
dropped silently; ``model`` is ignored (the job's model writes every row).
Body fields a line leaves out take the job's settings (not OpenAI's
defaults: ``--temperature`` decides).

Out: ``python -m jobs export DIR --format openai-batch --output FILE``
(`jobs.export`) writes one line per prompt whose completions are all
committed, in the Batch API's output format (`batch_lines`).
"""

from __future__ import annotations

import hashlib

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "n", "stop", "presence_penalty",
                   "frequency_penalty", "repetition_penalty")
IGNORED_FIELDS = {"model": "the job's model writes every row"}


def is_request(data: dict | None) -> bool:
    """Whether a row is a line of an OpenAI batch file."""
    return isinstance(data, dict) and "custom_id" in data and "body" in data


class UnknownFields:
    """Body fields that were not honoured, each reported once."""

    def __init__(self, log=None):
        self.log = log
        self.seen: set[str] = set()

    def report(self, names: list[str]) -> None:
        for name in names:
            if name in self.seen:
                continue
            self.seen.add(name)
            why = IGNORED_FIELDS.get(name, "this runner does not support it")
            if self.log is not None:
                self.log(f"note: OpenAI batch body field {name!r} is ignored ({why}); reported once")


def request_row(data: dict, id_field: str, prompt_field: str, messages_field: str) -> tuple[dict, list[str]]:
    """An OpenAI batch request line as a row of this runner, and the body
    fields it leaves unused.

    Raises:
        ValueError: The line is not a usable request (the message says why).
    """
    method = data.get("method", "POST")
    if method != "POST":
        raise ValueError(f"method must be 'POST', got {method!r}")
    body = data["body"]
    if not isinstance(body, dict):
        raise ValueError(f"body must be an object, got {type(body).__name__}")
    url = data.get("url") or (CHAT_URL if "messages" in body else COMPLETIONS_URL)
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise ValueError(f"url {url!r} is not supported; use {CHAT_URL} or {COMPLETIONS_URL}")
    row: dict = {id_field: data["custom_id"]}
    if url == CHAT_URL:
        if "messages" not in body:
            raise ValueError(f"a {CHAT_URL} body needs 'messages'")
        row[messages_field] = [_text_message(i, m) for i, m in enumerate(_list(body["messages"], "messages"))]
    else:
        if "prompt" not in body:
            raise ValueError(f"a {COMPLETIONS_URL} body needs 'prompt'")
        row[prompt_field] = body["prompt"]
    if body.get("max_completion_tokens") is not None:
        row["max_tokens"] = body["max_completion_tokens"]
    elif body.get("max_tokens") is not None:
        row["max_tokens"] = body["max_tokens"]
    for name in SAMPLING_FIELDS:
        if body.get(name) is not None:
            row[name] = body[name]
    if url == CHAT_URL and body.get("logprobs"):  # chat: logprobs true, top_logprobs N
        row["logprobs"] = body.get("top_logprobs") or 0
    elif url == COMPLETIONS_URL and body.get("logprobs") is not None:  # completions: logprobs N
        row["logprobs"] = body["logprobs"]
    if body.get("response_format") is not None:
        row["response_format"] = body["response_format"]
    used = {"messages", "prompt", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs",
            "response_format", *SAMPLING_FIELDS}
    unknown = sorted(k for k in body if k not in used and body[k] is not None)
    return row, unknown


def _list(value, name: str) -> list:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{name!r} must be a non-empty list")
    return value


def _text_message(i: int, m) -> dict:
    """A chat message with string content (OpenAI's list of text parts is
    joined; other parts are refused)."""
    if not isinstance(m, dict):
        raise ValueError(f"message {i} must be an object")
    content = m.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"message {i} has a {kind!r} content part; only text is supported")
            parts.append(part["text"])
        content = "".join(parts)
    return {**m, "content": content}


# -- export -------------------------------------------------------------------


def batch_lines(manifest: dict, rows: list[dict], token_text=None) -> tuple[list[dict], int]:
    """A job's committed rows as OpenAI batch output lines.

    One line per prompt id, its completions as ``choices`` (``index`` is the
    sample), in input order, made only when all of them are committed; a
    prompt with an error row is an error line. Returns (the lines, prompts
    left out because some completions are not committed yet).
    ``token_text`` names a token id (rows with log-probabilities need it).
    """
    model = manifest.get("model", {}).get("name", "")
    n_job = manifest.get("config", {}).get("n", 1)
    by_id: dict[str, list[dict]] = {}
    for row in rows:
        by_id.setdefault(row["id"], []).append(row)
    lines, incomplete = [], 0
    for rid, group in sorted(by_id.items(), key=lambda kv: min(r["index"] or 0 for r in kv[1])):
        group.sort(key=lambda r: r.get("sample") or 0)
        errors = [r for r in group if r["finish_reason"] == "error"]
        if errors:
            kind, _, message = (errors[0]["error"] or "error: ").partition(": ")
            lines.append({"id": _request_id(rid), "custom_id": rid, "response": None,
                          "error": {"code": kind, "message": message}})
            continue
        if len(group) < (group[0].get("n") or n_job):
            incomplete += 1
            continue
        lines.append(_response_line(rid, group, model, token_text))
    return lines, incomplete


def _request_id(rid: str) -> str:
    return "batch_req_" + hashlib.sha256(rid.encode()).hexdigest()[:24]


def _logprobs(row: dict, chat: bool, token_text) -> dict | None:
    """A row's log-probabilities in the API's shape: chat ``{"content":
    [{"token", "logprob", "bytes", "top_logprobs"}]}``, completions
    ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``."""
    values = row.get("logprobs")
    if values is None or token_text is None:
        return None
    tops = row.get("top_logprobs") or [[] for _ in values]
    tokens = row.get("token_ids") or []
    pieces = [token_text(t) for t in tokens]
    if chat:
        def entry(text, logprob):
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
        return {"content": [{**entry(text, lp), "top_logprobs": [entry(token_text(a["token"]), a["logprob"])
                                                                  for a in top]}
                            for text, lp, top in zip(pieces, values, tops)]}
    offsets = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
    return {"tokens": pieces, "token_logprobs": values,
            "top_logprobs": [{token_text(a["token"]): a["logprob"] for a in top} for top in tops],
            "text_offset": offsets}


def _response_line(rid: str, group: list[dict], model: str, token_text=None) -> dict:
    chat = bool(group[0].get("chat"))
    choices = []
    for r in group:
        choice = {"index": r.get("sample") or 0, "finish_reason": r["finish_reason"]}
        if chat:
            choice["message"] = {"role": "assistant", "content": r["completion"]}
        else:
            choice["text"] = r["completion"]
        choice["logprobs"] = _logprobs(r, chat, token_text)
        choices.append(choice)
    prompt_tokens = group[0]["prompt_tokens"] or 0
    completion_tokens = sum(r["completion_tokens"] or 0 for r in group)
    body = {
        "id": ("chatcmpl-" if chat else "cmpl-") + hashlib.sha256(rid.encode()).hexdigest()[:24],
        "object": "chat.completion" if chat else "text_completion",
        "model": model,
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }
    return {"id": _request_id(rid), "custom_id": rid,
            "response": {"status_code": 200, "request_id": _request_id(rid), "body": body}, "error": None}

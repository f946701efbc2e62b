"""Structured outputs: a row's output constrained to a JSON schema, any JSON
object, a regular expression or one of a list of strings.

A `Constraint` names what the output must match; `Grammars` (one per
engine) compiles it with llguidance into a `RowGrammar` per row, whose
state follows the row's tokens. At every generated position the row's
logits keep only the tokens its grammar allows there (`constrain`: the
others are -inf), before the token is chosen, in plain steps and at every
position of a verify forward alike, so speculation emits what constrained
plain decoding emits. Drafts are masked the same way as they are made, in
every mode: a chain (`mtp_engine.drafters.head`) advances the row's
grammar along its drafts (`RowGrammar.draft`) and goes back to the committed
tokens after the verify (`RowGrammar.commit`); the tree-shaped modes fork the
row's grammar per draft path (`PathGrammars`), follow each path with its
fork and drop the forks after the verify. So no draft breaks the grammar, and
the grammar advances along the accepted path only. EOS is allowed
only where the grammar may end; once the grammar can take no more tokens,
the row stops (finish reason "stop").

llguidance computes a mask from the grammar's state in tens to hundreds of
microseconds and compiles a JSON schema in about a millisecond, with no
index built per schema (docs/BENCHMARKS.md, "Structured outputs").
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

KINDS = ("json_object", "json_schema", "regex", "choice")
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON on one line, with a space after separators (as OpenAI's structured
outputs write it): no run of whitespace a model could loop in. A schema's
own ``"x-guidance"`` options override these."""


class ConstraintError(ValueError):
    """A constraint that cannot be compiled (the message names the problem)."""


@dataclass(frozen=True)
class Constraint:
    """What a row's output must match.

    Attributes:
        kind: "json_object" (any JSON object), "json_schema", "regex" or
            "choice" (exactly one of ``value``'s strings).
        value: The schema (JSON text, so the dataclass stays hashable), the
            regular expression, or the tuple of choices; None for
            "json_object".
    """

    kind: str
    value: str | tuple[str, ...] | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConstraintError(f"constraint kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "json_schema" and not isinstance(self.value, str):
            raise ConstraintError(f"a json_schema constraint holds the schema as JSON text, got {self.value!r}")
        if self.kind == "regex" and (not isinstance(self.value, str) or not self.value):
            raise ConstraintError(f"regex must be a non-empty string, got {self.value!r}")
        if self.kind == "choice" and (not isinstance(self.value, tuple) or not self.value
                                      or not all(isinstance(c, str) and c for c in self.value)):
            raise ConstraintError(f"choices must be a non-empty list of non-empty strings, got {self.value!r}")

    @classmethod
    def json_schema(cls, schema: dict | str) -> "Constraint":
        """A JSON schema (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ConstraintError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ConstraintError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema))  # key order kept: properties are written in it

    @classmethod
    def choice(cls, choices) -> "Constraint":
        if not isinstance(choices, (list, tuple)):
            raise ConstraintError(f"choices must be a list of strings, got {choices!r}")
        return cls("choice", tuple(choices))

    @classmethod
    def from_response_format(cls, response_format) -> "Constraint | None":
        """OpenAI's ``response_format``: ``{"type": "json_object"}``,
        ``{"type": "json_schema", "json_schema": {"schema": {...}, ...}}``
        or ``{"type": "text"}`` (None: unconstrained)."""
        if not isinstance(response_format, dict):
            raise ConstraintError(f"response_format must be an object, got {response_format!r}")
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls("json_object")
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, str)):
                raise ConstraintError("response_format json_schema needs {\"json_schema\": {\"schema\": {...}}}")
            return cls.json_schema(spec["schema"])
        raise ConstraintError(f"response_format type must be text, json_object or json_schema, got {kind!r}")

    def grammar(self) -> str:
        """The constraint as an llguidance grammar."""
        from llguidance import LLMatcher

        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(self.value, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.value)
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                  for c in self.value))

    def describe(self) -> str:
        return {"json_object": "a JSON object", "json_schema": "the JSON schema", "regex": "the regex",
                "choice": "one of the choices"}[self.kind]


def validate(constraint: Constraint) -> None:
    """Raise `ConstraintError` naming the problem unless the constraint
    compiles (no tokenizer needed: a job checks its rows before decoding)."""
    from llguidance import LLMatcher

    try:
        grammar = constraint.grammar()
    except ValueError as e:
        raise ConstraintError(f"invalid {constraint.kind}: {e}") from None
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise ConstraintError(f"invalid {constraint.kind}: {' '.join(error.split())}")


ROW_FIELDS = ("response_format", "json_schema", "regex", "choices")
"""The fields that give a row (or a job) its constraint; at most one."""


def from_fields(values: dict) -> Constraint | None:
    """The constraint of a row's (or a job's) fields `ROW_FIELDS`: an OpenAI
    ``response_format``, a ``json_schema`` (an object or its JSON text), a
    ``regex`` or a list of ``choices``; None when none is set.

    Raises:
        ConstraintError: Several are set, or one is malformed.
    """
    given = [name for name in ROW_FIELDS if values.get(name) is not None]
    if len(given) > 1:
        raise ConstraintError(f"set one of {', '.join(ROW_FIELDS)}, not {' and '.join(given)}")
    if not given:
        return None
    name, value = given[0], values[given[0]]
    if name == "response_format":
        return Constraint.from_response_format(value)
    if name == "json_schema":
        return Constraint.json_schema(value)
    if name == "regex":
        return Constraint("regex", value)
    return Constraint.choice(value)


class RowGrammar:
    """One row's grammar state: its committed tokens, then the drafts it
    has been advanced along in this step."""

    def __init__(self, compiler: "Grammars", matcher, eos: frozenset[int], constraint: Constraint):
        self.compiler = compiler
        self.matcher = matcher
        self.eos = eos
        self.constraint = constraint
        self.drafted = 0  # drafts consumed past the committed tokens
        self.ended = False  # a draft was EOS: the positions after it allow EOS only

    def draft(self, token: int) -> None:
        """Advance along a draft (one the mask allowed)."""
        if self.ended or token in self.eos:
            self.ended = True
            return
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"draft token {token} broke the grammar: {self.matcher.get_error()}")
        self.drafted += 1

    def commit(self, tokens: list[int]) -> bool:
        """Go back to the committed tokens and consume ``tokens`` (up to an
        EOS); return whether the grammar is complete (takes no more)."""
        if self.drafted:
            self.matcher.rollback(self.drafted)
        self.drafted, self.ended = 0, False
        for t in tokens:
            if t in self.eos:
                return True
            if not self.matcher.consume_token(t):
                raise RuntimeError(f"token {t} broke the grammar: {self.matcher.get_error()}")
        return self.complete

    def fork(self) -> "RowGrammar":
        """A copy in the same state that follows a draft path on its own."""
        copy = RowGrammar(self.compiler, self.matcher.deep_copy(), self.eos, self.constraint)
        copy.drafted, copy.ended = self.drafted, self.ended
        return copy

    def allows(self, tokens: list[int]) -> bool:
        """Whether the grammar takes ``tokens`` from its state (unchanged)."""
        if self.ended or self.complete:  # EOS only, as `Grammars.masks` allows
            return all(t in self.eos for t in tokens)
        return self.matcher.validate_tokens(tokens) == len(tokens)

    @property
    def complete(self) -> bool:
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()


class Grammars:
    """An engine's grammar compiler: the tokenizer as llguidance reads it
    (built on first use, about a second for a 151k vocabulary), compiled
    constraints and the masks of rows' states.

    Args:
        tokenizer_json: The tokenizer's ``tokenizer.json`` text.
        vocab_size: The model's vocabulary (its logits' width).
        eos: The model's EOS ids.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: set[int]):
        import llguidance

        self.vocab_size = vocab_size
        self.eos = frozenset(eos)
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos))
        self.words = (vocab_size + 31) // 32
        self._grammars: dict[Constraint, str] = {}
        self._fresh: dict = {}  # each constraint's matcher at the start, copied for each row
        self.masks_made = 0  # rows' masks computed, and the host seconds they took (benchmarks read them)
        self.mask_s = 0.0
        self.fallbacks = 0  # branches that took their sibling's top token (`PathGrammars.advance`)

    def check(self, constraint: Constraint) -> str:
        """The constraint's compiled grammar text; raises `ConstraintError`
        naming the problem (an invalid schema or regex, an unsupported
        schema keyword)."""
        from llguidance import LLMatcher

        if constraint not in self._grammars:
            try:
                grammar = constraint.grammar()
            except ValueError as e:
                raise ConstraintError(f"invalid {constraint.kind}: {e}") from None
            error = LLMatcher.validate_grammar(grammar, self.tokenizer)
            if error:
                raise ConstraintError(f"invalid {constraint.kind}: {' '.join(error.split())}")
            self._grammars[constraint] = grammar
        return self._grammars[constraint]

    def row(self, constraint: Constraint) -> RowGrammar:
        """A fresh `RowGrammar` at the start of the output (a copy of the
        constraint's first matcher: building one takes ~1 ms, copying it a
        few microseconds)."""
        from llguidance import LLMatcher

        fresh = self._fresh.get(constraint)
        if fresh is None:
            fresh = LLMatcher(self.tokenizer, self.check(constraint), log_level=0)
            if fresh.is_error():
                raise ConstraintError(f"invalid {constraint.kind}: {fresh.get_error()}")
            self._fresh[constraint] = fresh
        return RowGrammar(self, fresh.deep_copy(), self.eos, constraint)

    def masks(self, grammars: list[RowGrammar | None]) -> mx.array:
        """``[R, 1, vocab]`` bool: the tokens each row's grammar allows next
        (every token for a row without one)."""
        t0 = time.perf_counter()
        bits = np.full((len(grammars), self.words), -1, dtype=np.int32)
        ended = []
        for r, g in enumerate(grammars):
            if g is not None and g.ended:
                ended.append(r)
            elif g is not None:
                g.matcher.unsafe_compute_mask_ptr(bits[r].ctypes.data, bits[r].nbytes)
        allowed = np.unpackbits(bits.view(np.uint8), axis=-1, bitorder="little")[:, : self.vocab_size].astype(np.bool_)
        for r in ended:
            allowed[r] = False
            allowed[r, sorted(self.eos)] = True
        out = mx.array(allowed)[:, None]
        self.masks_made += sum(g is not None for g in grammars)
        self.mask_s += time.perf_counter() - t0
        return out


def tokenizer_json(tokenizer) -> str:
    """The ``tokenizer.json`` text of an mlx-lm ``TokenizerWrapper`` (or a
    Hugging Face tokenizer) backed by the tokenizers library."""
    backend = getattr(getattr(tokenizer, "_tokenizer", tokenizer), "backend_tokenizer", None)
    if backend is None:
        raise ConstraintError("constrained decoding needs a tokenizer backed by the tokenizers library "
                              "(a tokenizer.json)")
    return backend.to_str()


def masks_of(grammars: list[RowGrammar | None]) -> mx.array | None:
    """`Grammars.masks` of rows of which some may be constrained; None when
    none is."""
    compiler = next((g.compiler for g in grammars if g is not None), None)
    return None if compiler is None else compiler.masks(grammars)


class PathGrammars:
    """The grammars of one step's draft paths (the tree-shaped modes): per
    path a fork of its row's grammar (`RowGrammar.fork`) that follows the
    path's drafts, and the masks of every position drafted so far, which the
    verify forward applies to the trunk's logits. The rows' own grammars are
    untouched: after the verify they take the emitted tokens (the accepted
    path) and the forks are dropped. Every method is a no-op when no row has
    a grammar (`on` is False).

    Args:
        grammars: Each row's grammar or None (one path per row to start).
    """

    def __init__(self, grammars: list[RowGrammar | None] | None):
        self.on = grammars is not None and any(g is not None for g in grammars)
        self.forks = [None if g is None else g.fork() for g in grammars] if self.on else []
        self.kept: list[mx.array] = []  # per drafted position, [P, 1, vocab] for the current paths

    def constrain(self, logits: mx.array) -> mx.array:
        """The current paths' head logits ``[P, vocab]`` with what their
        grammars disallow at -inf; the masks are kept for the verify."""
        if not self.on:
            return logits
        self.kept.append(masks_of(self.forks))
        return constrain(logits, self.kept[-1][:, 0])

    def take(self, index: list[int]) -> None:
        """The paths branch: new path ``i`` continues path ``index[i]``."""
        if not self.on:
            return
        self.forks = [None if self.forks[p] is None else self.forks[p].fork() for p in index]
        rows = mx.array(index, dtype=mx.int32)
        self.kept = [m[rows] for m in self.kept]

    def advance(self, tokens: list[int], fallback: list[int] | None = None,
                moving: list[bool] | None = None) -> list[int]:
        """Each path's fork follows its new token; returns the tokens.

        Args:
            tokens: Each path's draft at this position.
            fallback: Each path's sibling's top token: a path whose token
                its grammar does not take (a branch ranked below the tokens
                the grammar allows there) takes it instead.
            moving: Paths that still draft; the others' later positions
                allow EOS only (they are padding the verify does not use).
        """
        if not self.on:
            return tokens
        out = list(tokens)
        for p, g in enumerate(self.forks):
            if g is None:
                continue
            if moving is not None and not moving[p]:
                g.ended = True
                continue
            if fallback is not None and not g.allows([out[p]]):
                out[p] = fallback[p]
                g.compiler.fallbacks += 1
            g.draft(out[p])
        return out

    def masks(self, rows: list[int] | None = None) -> mx.array | None:
        """``[V, K+1, vocab]``: the masks of the drafted positions and of the
        bonus position after them, for the paths ``rows`` (default all, in
        order); None when no row has a grammar."""
        if not self.on:
            return None
        out = mx.concatenate(self.kept + [masks_of(self.forks)], axis=1)
        return out if rows is None else out[mx.array(rows, dtype=mx.int32)]


def constrain(logits: mx.array, masks: mx.array | None) -> mx.array:
    """``[R, T, V]`` logits with the tokens ``masks`` (bool, broadcastable)
    disallows at -inf; unchanged without masks."""
    if masks is None:
        return logits
    return mx.where(masks, logits, mx.array(-mx.inf, dtype=logits.dtype))

"""Job configuration: one validated dataclass, built by the CLI (flags over a
YAML/JSON config file over defaults) and fingerprinted for resume."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields, replace
from functools import cached_property
from pathlib import Path

from mtp_engine.constraints import Constraint, ConstraintError, from_fields, validate
from mtp_engine.model.hub import resolve_model
from mtp_engine.modes import DecodeConfig
from mtp_engine.options import EngineOptions
from mtp_engine.sampling import SamplingParams

PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")
from schemas import SCHEMA_VERSION

BATCHED_MODES = ("auto", "chain", "baseline")
"""Modes that decode `DEFAULT_BATCH_SIZE` rows at once unless told; the tree
modes default to one row at a time (each of their rows verifies several
paths)."""

DEFAULT_BATCH_SIZE = 32

SPEED_ONLY = ("mode", "draft_tokens", "paths", "tau", "tree_pos2", "drafter", "batch_size")
"""Decoding settings that change speed, never the tokens (every mode is
lossless, and the exact sampler's tokens depend on the seed only), so a
folder resumes under other values of them. Under the rejection sampler the
mode and K decide the tokens too (`output_parts`)."""

MAX_N = 256
"""Most completions per prompt."""


class ConfigError(ValueError):
    """A bad job configuration value, named with the value."""


@dataclass(frozen=True)
class JobConfig:
    """Everything a generation job needs.

    Attributes:
        dataset: Prompt file, glob of files, or ``save_to_disk`` folder.
        model: Checkpoint folder.
        output: Output folder (created; resumed when it exists).
        mode: A decoding mode of the engine (`mtp_engine.modes.MODES`).
            The default, "auto", chooses each step's drafts, 0..K, from the
            acceptance and step costs it measures (`mtp_engine.controller`),
            decoding plainly where drafts do not pay; "baseline" is plain
            batching (docs/BENCHMARKS.md, "Jobs end to end").
        draft_tokens, paths, tau, tree_pos2, drafter: As `DecodeConfig`.
        max_tokens: Default token budget per row (rows may override).
        stop: Default stop strings (rows may override).
        batch_size: Rows decoded at once (None: `DEFAULT_BATCH_SIZE` in
            `BATCHED_MODES`, 1 in the tree modes).
        rows_per_shard: Rows per committed shard.
        commit_seconds: Commit a shard at least this often when rows are done.
        prompt_field: Field holding a prompt string.
        messages_field: Field holding chat messages.
        id_field: Field holding the row id (else the row number is used).
        system_prompt: System message prepended to chat rows without one.
        overwrite: Delete an existing output folder's results and start over.
        allow_dataset_change: Resume a folder written from another dataset
            (its rows are kept; the new dataset's rows are added).
        limit: Process only the first ``limit`` rows of the dataset.
        temperature, top_p, top_k, min_p: As `SamplingParams` (rows may
            override them); temperature 0 decodes greedily.
        repetition_penalty, presence_penalty, frequency_penalty: As
            `SamplingParams` (rows may override them; greedy rows use them
            too).
        seed: The job's seed; completion ``j`` of row ``id`` samples with a
            seed derived from it (or from the row's own ``seed``), the id
            and ``j`` (`jobs.prompts.completion_seed`).
        n: Completions per prompt (rows may override); each is an output
            row with its ``sample`` index.
        sampler: "exact" (the tokens depend on the seed only: every mode,
            batch size and rank writes the same rows) or "rejection"
            (speculative sampling: lossless in distribution; chain mode).
        fast_paths: Engine fast-path switches, ``(name, value)`` pairs of
            `EngineOptions` fields over its environment defaults (speed
            only: not part of the job's fingerprint).
        warm_up: Meet every step shape once before the first row
            (`mtp_engine.decoder.Decoder.warm_up`), so no row pays a
            kernel's first use; None: on a GPU, where that costs, not on the
            CPU, where it does not (speed only).
        quiet: Print only notes, warnings and the result (no job line,
            fast paths or progress).
        verbose: Print each fast path's state on its own line.
        max_error_rate: The share of a run's rows that may be error rows
            before the command exits 1 (the rows stay committed).
        chat_template: A Jinja file rendering chat rows instead of the
            model's own template.
        chat_template_kwargs: Extra variables for the chat template, as
            Hugging Face's ``apply_chat_template`` takes them (for example
            ``{"enable_thinking": false}`` for Qwen3 templates).
        prefix_sharing: Prefill prompt prefixes shared by rows once
            (`jobs.prefixes`; speed only).
        prefix_min_tokens: The shortest shared run worth a prefix.
        prefix_cache_gb: The kept prefixes' memory budget (None: 5% of
            the machine's memory, at most 4 GiB).
        logprobs: 0..20: store each generated token's log-probability and
            that many alternatives (None: none; rows may set their own).
        keep_columns: Input columns every output row carries (as text):
            None keeps each one whose name no output column has; a tuple
            names them (empty: none).
        json_schema, regex, choices: The output constraint of rows that set
            none of their own (`mtp_engine.constraints`): a JSON schema
            file, a regular expression, or the strings the output must be
            one of (a list, a JSON list or comma-separated text); at most
            one.
    """

    dataset: str
    model: str
    output: str
    mode: str = "auto"
    draft_tokens: int = DecodeConfig.draft_tokens
    paths: int = DecodeConfig.paths
    tau: float = DecodeConfig.tau
    tree_pos2: bool = DecodeConfig.tree_pos2
    drafter: str = DecodeConfig.drafter
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    batch_size: int | None = None
    rows_per_shard: int = 256
    commit_seconds: float = 60.0
    prompt_field: str = "prompt"
    messages_field: str = "messages"
    id_field: str = "id"
    system_prompt: str | None = None
    overwrite: bool = False
    allow_dataset_change: bool = False
    limit: int | None = None
    temperature: float = SamplingParams.temperature
    top_p: float = SamplingParams.top_p
    top_k: int = SamplingParams.top_k
    min_p: float = SamplingParams.min_p
    seed: int = SamplingParams.seed
    n: int = 1
    sampler: str = SamplingParams.sampler
    repetition_penalty: float = SamplingParams.repetition_penalty
    presence_penalty: float = SamplingParams.presence_penalty
    frequency_penalty: float = SamplingParams.frequency_penalty
    fast_paths: tuple[tuple[str, object], ...] = ()
    warm_up: bool | None = None
    quiet: bool = False
    verbose: bool = False
    max_error_rate: float = 0.5
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None
    prefix_sharing: bool = True
    prefix_min_tokens: int = 256
    prefix_cache_gb: float | None = None
    keep_columns: tuple[str, ...] | None = None
    logprobs: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    choices: tuple[str, ...] | None = None

    def __post_init__(self):
        for f in fields(self):  # a config file's "false" is not a boolean, 5 is not a list of stop strings
            value = getattr(self, f.name)
            kind, optional = f.type.removesuffix(" | None"), f.type.endswith(" | None")
            if value is None and optional:
                continue
            expected = _EXPECTED_TYPES.get(kind)
            if expected is not None and not _is(value, kind):
                raise ConfigError(f"{f.name} must be {expected}{' (or unset)' if optional else ''}, got {value!r}")
        for name in ("dataset", "model", "output", "prompt_field", "messages_field", "id_field"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{name} must be a non-empty string, got {value!r}")
        try:  # the decoding fields, as the engine validates them
            DecodeConfig(mode=self.mode, draft_tokens=self.draft_tokens,
                         tau=self.tau, paths=self.paths, tree_pos2=self.tree_pos2, drafter=self.drafter)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        _positive_int("prefix_min_tokens", self.prefix_min_tokens)
        if self.prefix_cache_gb is not None and not self.prefix_cache_gb > 0:
            raise ConfigError(f"prefix_cache_gb must be > 0, got {self.prefix_cache_gb!r}")
        if not 0 <= self.max_error_rate <= 1:
            raise ConfigError(f"max_error_rate must be in 0..1, got {self.max_error_rate!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ConfigError(f"logprobs must be an integer in 0..20, got {self.logprobs!r}")
        if self.quiet and self.verbose:
            raise ConfigError("quiet and verbose exclude each other; choose one")
        _positive_int("max_tokens", self.max_tokens)
        if self.batch_size is not None:
            _positive_int("batch_size", self.batch_size, 1024)
        _positive_int("rows_per_shard", self.rows_per_shard)
        if self.limit is not None:
            _positive_int("limit", self.limit)
        if not isinstance(self.commit_seconds, (int, float)) or self.commit_seconds <= 0:
            raise ConfigError(f"commit_seconds must be > 0, got {self.commit_seconds!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ConfigError(f"stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "fast_paths", _fast_path_pairs(self.fast_paths))
        if isinstance(self.keep_columns, str):  # the flag's form: all, none, or NAME,NAME
            text = self.keep_columns.strip()
            names = None if text == "all" else () if text in ("", "none") else tuple(n.strip() for n in text.split(","))
            object.__setattr__(self, "keep_columns", names)
        elif self.keep_columns is not None:
            object.__setattr__(self, "keep_columns", tuple(self.keep_columns))
        if self.keep_columns is not None and not all(isinstance(n, str) and n for n in self.keep_columns):
            raise ConfigError(f"keep_columns must be column names, got {self.keep_columns!r}")
        try:
            self.sampling()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        _positive_int("n", self.n, MAX_N)
        if self.n > 1 and self.temperature == 0:
            raise ConfigError(f"n = {self.n} with temperature 0 would write {self.n} copies of one greedy "
                              "completion; set --temperature above 0 (or n = 1)")
        if isinstance(self.choices, str):  # the flag's form: a JSON list, or comma-separated
            text = self.choices.strip()
            try:
                choices = json.loads(text) if text.startswith("[") else [c.strip() for c in text.split(",")]
            except ValueError as e:
                raise ConfigError(f"choices {self.choices!r} is not a JSON list: {e}") from None
            object.__setattr__(self, "choices", choices)
        if self.choices is not None:
            object.__setattr__(self, "choices", tuple(self.choices))
        try:
            constraint = self.constraint()
            if constraint is not None:
                validate(constraint)
        except ConstraintError as e:
            raise ConfigError(str(e)) from None
        if self.sampler == "rejection" and self.mode not in ("chain", "baseline", "auto"):
            raise ConfigError(f"sampler 'rejection' drafts chains; mode {self.mode!r} needs sampler 'exact' "
                              "(or mode chain)")

    def sampling(self) -> SamplingParams:
        """The job's sampling settings (each completion's seed is derived
        from ``seed``)."""
        return SamplingParams(self.temperature, self.top_p, self.top_k, self.min_p, self.seed, self.sampler,
                              self.repetition_penalty, self.presence_penalty, self.frequency_penalty)

    def constraint(self) -> Constraint | None:
        """The job's output constraint (rows may set their own), read once."""
        return self._constraint

    @cached_property
    def _constraint(self) -> Constraint | None:
        schema = None
        if self.json_schema is not None:
            try:
                schema = Path(self.json_schema).expanduser().read_text()
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(f"json_schema {self.json_schema!r} cannot be read: "
                                  f"{getattr(e, 'strerror', None) or e}") from None
        try:
            return from_fields({"json_schema": schema, "regex": self.regex, "choices": self.choices})
        except ConstraintError as e:
            raise ConfigError(f"json_schema {self.json_schema!r}: {e}" if schema is not None else str(e)) from None

    def engine_options(self) -> EngineOptions:
        """The engine's fast-path switches: environment defaults, then ours."""
        try:
            return EngineOptions.from_env(**dict(self.fast_paths))
        except ValueError as e:
            raise ConfigError(str(e)) from None

    @classmethod
    def from_sources(cls, file_values: dict, flag_values: dict) -> "JobConfig":
        """Merge defaults < config file < flags (None flags are unset)."""
        known = {f.name for f in fields(cls)}
        merged: dict = {}
        for source, values in (("config file", file_values), ("flags", flag_values)):
            for key, value in values.items():
                name = key.replace("-", "_")
                if name not in known:
                    raise ConfigError(f"unknown key {key!r} in {source}")
                if value is not None:
                    merged[name] = value
        missing = [k for k in ("dataset", "model", "output") if k not in merged]
        if missing:
            raise ConfigError(f"missing required setting(s): {', '.join(missing)}")
        if "stop" in merged and isinstance(merged["stop"], list):
            merged["stop"] = tuple(merged["stop"])
        return cls(**merged)

    def resolved(self) -> "JobConfig":
        """The config with an unset batch size replaced by its default."""
        if self.batch_size is not None:
            return self
        return replace(self, batch_size=DEFAULT_BATCH_SIZE if self.mode in BATCHED_MODES else 1)

    def decode_config(self) -> DecodeConfig:
        """The engine's decoding settings (of a `resolved` config)."""
        return DecodeConfig(mode=self.mode, draft_tokens=self.draft_tokens, tau=self.tau, paths=self.paths,
                            tree_pos2=self.tree_pos2, batch_size=self.batch_size or 1, drafter=self.drafter)

    def decoding(self, schema_version: int = SCHEMA_VERSION) -> dict:
        """The decoding settings (fingerprinted; `SPEED_ONLY` ones are not
        compared on resume). Folders of output schema 1 (greedy, one
        completion per prompt) had no sampling settings."""
        d = {"mode": self.mode, "max_tokens": self.max_tokens, "stop": list(self.stop)}
        if schema_version >= 2:
            d["sampling"] = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                             "min_p": self.min_p, "seed": self.seed, "n": self.n, "sampler": self.sampler}
            for name in PENALTIES:  # only when set: folders written before penalties keep their fingerprint
                if getattr(self, name) != getattr(SamplingParams, name):
                    d["sampling"][name] = getattr(self, name)
        constraint = self.constraint()
        if constraint is not None:  # only then: folders written before constraints keep their fingerprint
            d["constraint"] = {"kind": constraint.kind, "value": constraint.value}
        if self.mode != "baseline":
            d["draft_tokens"] = self.draft_tokens
            if self.mode == "paths":
                d["paths"] = self.paths
            if self.mode in ("adaptive", "adaptive_tree"):
                d["tau"] = self.tau
        return d

    def rendering(self) -> dict:
        """How rows become prompts (fingerprinted; the template itself is
        fingerprinted by its hash, `fingerprint_parts`)."""
        d = {
            "prompt_field": self.prompt_field,
            "messages_field": self.messages_field,
            "id_field": self.id_field,
            "system_prompt": self.system_prompt,
            "add_generation_prompt": True,
        }
        if self.chat_template_kwargs:
            d["chat_template_kwargs"] = self.chat_template_kwargs
        return d

    def template_text(self) -> str | None:
        """The ``chat_template`` file's text (None: the model's template).

        Raises:
            ConfigError: The file cannot be read.
        """
        if self.chat_template is None:
            return None
        try:
            return Path(self.chat_template).expanduser().read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"chat_template {self.chat_template!r} cannot be read: "
                              f"{getattr(e, 'strerror', None) or e}") from None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stop"] = list(self.stop)
        d["fast_paths"] = dict(self.fast_paths)
        return d


_EXPECTED_TYPES = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "a string",
                   "dict": "a mapping (a JSON object)",
                   "tuple[str, ...]": "a string or a list of strings",
                   "tuple[tuple[str, object], ...]": "a mapping or a list of NAME=VALUE strings"}


def _is(value, kind: str) -> bool:
    """Whether ``value`` has the field type ``kind`` (a config file's or
    flag's form of it: lists for tuples, an int for a float)."""
    if kind == "bool":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind == "int":
        return isinstance(value, int)
    if kind == "float":
        return isinstance(value, (int, float))
    if kind == "str":
        return isinstance(value, str)
    if kind == "dict":
        return isinstance(value, dict) and all(isinstance(k, str) for k in value)
    if kind == "tuple[str, ...]":
        return isinstance(value, (str, list, tuple))
    return isinstance(value, (dict, list, tuple))


def _fast_path_pairs(value) -> tuple[tuple[str, object], ...]:
    """``fast_paths`` as validated pairs: from CLI strings ``NAME=VALUE``, a
    mapping (config file) or pairs."""
    if isinstance(value, dict):
        value = list(value.items())
    pairs = []
    for item in value or ():
        try:
            name, v = EngineOptions.parse_switch(item) if isinstance(item, str) else tuple(item)
            if isinstance(v, str):
                name, v = EngineOptions.parse_switch(f"{name}={v}")
            EngineOptions().with_switches(**{name: v})
        except (ValueError, TypeError) as e:
            raise ConfigError(f"fast path {item!r}: {e}") from None
        pairs.append((name, v))
    return tuple(pairs)


def _positive_int(name: str, value, most: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if most is not None and value > most:
        raise ConfigError(f"{name} must be at most {most}, got {value!r}")


def read_config_file(path: str | Path) -> dict:
    """Read a YAML (.yaml/.yml) or JSON config file into a dict."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    text = p.read_text()
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # yaml and json raise different types
        raise ConfigError(f"cannot parse config file {str(path)!r}: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping, got {type(data).__name__}")
    return data


def model_identity(model_dir: str | Path) -> dict:
    """What identifies a model for resume: config, tokenizer and weight headers.

    Hashes ``config.json``, the tokenizer files and every safetensors file's
    name, size and header (tensor names, dtypes, shapes, offsets); not the
    weights themselves, which can be many gigabytes.
    """
    folder = resolve_model(model_dir).resolve()
    h = hashlib.sha256()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        p = folder / name
        if p.exists():
            h.update(name.encode() + b"\0" + p.read_bytes())
    for p in sorted(folder.glob("*.safetensors")):
        with open(p, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = f.read(size)
        h.update(p.name.encode() + b"\0" + str(p.stat().st_size).encode() + header)
    revision = folder.name if folder.parent.name == "snapshots" else None
    return {"name": folder.name, "revision": revision, "sha256": h.hexdigest()[:16]}


def fingerprint_parts(config: JobConfig, model_id: dict, chat_template: str | None,
                      schema_version: int = SCHEMA_VERSION, kept_columns: list[str] | tuple = (),
                      logprob_columns: bool = False) -> dict:
    template_sha = hashlib.sha256((chat_template or "").encode()).hexdigest()[:16]
    parts = {
        "model": model_id["sha256"],
        "rendering": {**config.rendering(), "chat_template_sha256": template_sha},
        "decoding": config.decoding(schema_version),
        "schema_version": schema_version,
    }
    if kept_columns:  # only then: folders written before columns were kept keep their fingerprint
        parts["kept_columns"] = list(kept_columns)
    if logprob_columns:
        parts["logprobs"] = config.logprobs
    return parts


def fingerprint(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def output_parts(parts: dict) -> dict:
    """Fingerprint parts without the `SPEED_ONLY` settings: what decides the
    tokens. Two jobs whose output parts agree write the same rows (the
    rejection sampler's tokens depend on the mode and K as well)."""
    decoding = parts.get("decoding", {})
    keep = ("mode", "draft_tokens") if decoding.get("sampling", {}).get("sampler") == "rejection" else ()
    decoding = {k: v for k, v in decoding.items() if k not in SPEED_ONLY or k in keep}
    return {**parts, "decoding": decoding}


def describe_changes(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Human-readable differences between two fingerprint part dicts."""
    changes = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            changes += describe_changes(a, b, name + ".")
        elif a != b:
            changes.append(f"{name}: {a!r} -> {b!r}")
    return changes

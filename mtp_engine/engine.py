"""The persistent MTP speculative decoding engine.

Contract: the engine knows nothing about files of jobs, shards or datasets.
It loads a checkpoint once; every call builds fresh caches, so nothing
leaks between prompts. Speculative output equals plain decoding of the same
model (greedy, and the exact sampler for a seed). Every call decodes through
one `mtp_engine.decoder.Decoder`: `generate` is a batch of one row,
`generate_samples` n rows of one prompt, `generate_batch` many prompts at
``decode.batch_size`` rows at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import mlx.core as mx

from mtp_engine.constraints import Constraint, Grammars, tokenizer_json
from mtp_engine.decoder import Decoder
from mtp_engine.drafters.select import DrafterParts, build_drafters, make_drafter, pick
from mtp_engine.kernels import cpu_blas
from mtp_engine.model.family import language_model, lm_head_module
from mtp_engine.model.loader import LoadedCheckpoint, load_checkpoint
from mtp_engine.modes import FIELDS as DECODE_FIELDS
from mtp_engine.modes import DecodeConfig
from mtp_engine.options import EngineOptions, FastPathStatus
from mtp_engine.prefix import PrefixState, build_prefix
from mtp_engine.backend import apply_process_settings, attention_status
from mtp_engine.sampling import FIELDS as SAMPLING_FIELDS
from mtp_engine.sampling import SamplingParams, make_sampling
from schemas.records import GenerationResult


class PromptTooLongError(ValueError):
    """The prompt does not fit the model's context."""


class MTPEngine:
    """Loads a Qwen3-Next or Qwen3.5 checkpoint with its MTP head once; decodes prompts
    with lossless speculative decoding.

    Args:
        checkpoint: What `load_checkpoint` returned (its ``options`` hold
            the fast-path switches, see `mtp_engine.options`).
        prefill_step_size: Prompt tokens per prefill forward (as mlx-lm).
    """

    def __init__(self, checkpoint: LoadedCheckpoint, *, prefill_step_size: int = 2048):
        self.checkpoint = checkpoint
        self.options = checkpoint.options
        self.model = checkpoint.model
        # Inference mode, as mlx_lm.load leaves a model: the engine's own
        # recurrence serves only layers that are not training.
        self.model.eval()
        checkpoint.head.eval()
        self.tokenizer = checkpoint.tokenizer
        self.config = checkpoint.config
        self.prefill_step_size = prefill_step_size
        apply_process_settings(self.options)
        # The text model: the trunk itself (Qwen3-Next) or its language model (Qwen3.5).
        self.text = language_model(self.model)
        self.drafters: DrafterParts = build_drafters(checkpoint.head, self.text.model.embed_tokens, self.lm_head,
                                                     lm_head_module(self.model), prefill_step_size, self.options)
        self.fast_paths: list[FastPathStatus] = [cpu_blas.status(self.options), *checkpoint.fast_paths,
                                                 *self.drafters.statuses, attention_status()]
        self._grammars: Grammars | None = None  # built when the first constrained row comes
        self.warmed: dict = {}  # (decode, sampling) settings -> the step costs their warm-up measured (`warmup`)

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        dtype: str | None = None,
        options: EngineOptions | None = None,
        prefill_step_size: int = 2048,
        **switches,
    ) -> "MTPEngine":
        """Load a checkpoint folder (Hub layout, or mlx_lm.convert output that
        holds the ``mtp.*`` tensors).

        Args:
            path: The folder.
            dtype: Cast the weights ("float32", "bfloat16", "float16").
            options: Fast-path switches (default: `EngineOptions.from_env`).
            prefill_step_size: Prompt tokens per prefill forward.
            **switches: `EngineOptions` fields to change (``compile_layers=False``).

        Raises:
            See `load_checkpoint`; ValueError for an unknown switch.
        """
        options = (options if options is not None else EngineOptions.from_env()).with_switches(**switches)
        return cls(load_checkpoint(path, dtype=dtype, options=options), prefill_step_size=prefill_step_size)

    # -- model plumbing ------------------------------------------------------

    def lm_head(self, hidden: mx.array) -> mx.array:
        if self.text.args.tie_word_embeddings:
            return self.text.model.embed_tokens.as_linear(hidden)
        return self.text.lm_head(hidden)

    @property
    def eos_token_ids(self) -> set[int]:
        return set(self.tokenizer.eos_token_ids)

    @property
    def context_length(self) -> int:
        return self.checkpoint.context_length

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (a string is tokenized as is, no template)."""
        ids = isinstance(prompt, (list, tuple)) and all(type(t) is not bool and isinstance(t, int) for t in prompt)
        if not ids and not isinstance(prompt, str):
            raise TypeError("prompt must be a string or a list of token ids (ints)")
        if not prompt:
            raise ValueError("prompt is empty")
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        vocab = self.text.args.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        return list(prompt)

    def check_prompt(self, ids: list[int]) -> list[int]:
        """Raise `PromptTooLongError` unless ``ids`` leaves room to generate."""
        if len(ids) >= self.context_length:
            raise PromptTooLongError(f"prompt has {len(ids)} tokens; the model's context is {self.context_length}")
        return ids

    def prefill_prefix(self, prefix: str | list[int]) -> PrefixState:
        """Prefill a prompt prefix once (a system prompt, a few-shot block)
        for many prompts that start with it: pass the result as ``prefix=``
        to `generate`, `generate_samples` or `generate_batch`, and each such
        prompt prefills only the tokens after it (`mtp_engine.prefix`).

        Raises:
            ValueError: An empty prefix, or one that leaves no context.
        """
        return build_prefix(self, self.check_prompt(self.encode(prefix)))

    # -- generation ------------------------------------------------------------

    @property
    def grammars(self) -> Grammars:
        """The grammar compiler of constrained rows (`mtp_engine.constraints`), built on first use."""
        if self._grammars is None:
            self._grammars = Grammars(tokenizer_json(self.tokenizer), self.text.args.vocab_size, self.eos_token_ids)
        return self._grammars

    def pick_drafter(self, mode: str, choice: str = "auto", greedy: bool = True, masked: bool = False) -> str:
        """The drafter ``choice`` means for ``mode`` here (`mtp_engine.drafters.select.pick`)."""
        return pick(self.drafters, mode, choice, greedy, masked)

    def make_drafter(self, kind: str):
        """A fresh drafter of ``kind`` for a decoder's rows."""
        return make_drafter(self.drafters, kind)

    def configs(self, decode: DecodeConfig | None = None, sampling: SamplingParams | None = None,
                **shortcuts) -> tuple[DecodeConfig, dict]:
        """``decode`` with the `DecodeConfig` fields among ``shortcuts``
        changed, and the sampling fields (those of ``sampling``, then the
        shortcuts). A keyword that is neither is a TypeError naming it."""
        unknown = sorted(set(shortcuts) - set(DECODE_FIELDS) - set(SAMPLING_FIELDS))
        if unknown:
            raise TypeError(f"unknown keyword {unknown[0]!r}; decoding takes {', '.join(DECODE_FIELDS)}, "
                            f"sampling {', '.join(SAMPLING_FIELDS)}")
        decode = replace(decode or DecodeConfig(), **{k: v for k, v in shortcuts.items() if k in DECODE_FIELDS})
        values = {k: getattr(sampling, k) for k in SAMPLING_FIELDS} if sampling is not None else {}
        values.update({k: v for k, v in shortcuts.items() if k in SAMPLING_FIELDS})
        return decode, values

    def generate(self, prompt: str | list[int], *, decode: DecodeConfig | None = None,
                 sampling: SamplingParams | None = None, max_tokens: int = 256,
                 stop: str | list[str] | None = None, trace: bool = False, prefix: PrefixState | None = None,
                 logprobs: int | None = None, constraint: Constraint | None = None, **shortcuts) -> GenerationResult:
        """Decode one prompt: greedily, or sampling (`mtp_engine.sampling`).

        Args:
            prompt: Text (tokenized as is) or token ids.
            decode: Mode, K, tau, paths, drafter (`DecodeConfig`).
            sampling: Temperature, filters, seed, sampler (`SamplingParams`;
                default greedy). An unset seed is a fresh random one
                (recorded in ``result.stats.seed``).
            max_tokens: Most tokens to generate.
            stop: Stop string(s); the text is cut before the first one.
            trace: Record every verify step in ``result.trace``.
            prefix: A `prefill_prefix` result the prompt starts with: only
                the tokens after it are prefilled.
            logprobs: 0..20: record each token's log-probability and that
                many likeliest alternatives in ``result.logprobs``
                (`mtp_engine.sampling.token_logprobs`).
            constraint: What the output must match (`mtp_engine.constraints`).
            **shortcuts: Fields of either config, e.g. ``mode="tree"``,
                ``temperature=0.8, seed=7``.

        Returns:
            A `GenerationResult`.

        Raises:
            ValueError: Bad parameters, an empty prompt, or
                `PromptTooLongError` for a prompt over the context.
        """
        decode, values = self.configs(decode, sampling, **shortcuts)
        (_, result), = self._decode([prompt], replace(decode, batch_size=1), [[make_sampling(**values)]],
                                    [max_tokens], stop, trace, prefix, strict=True, logprobs=logprobs,
                                    constraints=[constraint])
        return result

    def generate_samples(self, prompt: str | list[int], *, seeds: list[int | None],
                         decode: DecodeConfig | None = None, sampling: SamplingParams | None = None,
                         max_tokens: int = 256, stop: str | list[str] | None = None, trace: bool = False,
                         prefix: PrefixState | None = None, logprobs: int | None = None,
                         constraint: Constraint | None = None, **shortcuts) -> list[GenerationResult]:
        """Several completions of one prompt, one per seed, decoded together
        as rows sharing one prefill. Each result equals `generate` with that
        seed. Arguments as `generate`."""
        if not isinstance(seeds, (list, tuple)) or not seeds:
            raise ValueError(f"seeds must be a non-empty list, got {seeds!r}")
        decode, values = self.configs(decode, sampling, **shortcuts)
        samples = [make_sampling(**{**values, "seed": seed}) for seed in seeds]
        rows = self._decode([prompt], replace(decode, batch_size=len(samples)), [samples], [max_tokens], stop, trace,
                            prefix, strict=True, logprobs=logprobs, constraints=[constraint])
        return [result for _, result in sorted(rows, key=lambda row: row[0])]

    def generate_batch_iter(self, prompts: list[str | list[int]], *, decode: DecodeConfig | None = None,
                            sampling: SamplingParams | None = None, max_tokens: int | list[int] = 256,
                            stop: str | list[str] | None = None, seed: int | list[int | None] | None = None,
                            prefix: PrefixState | None = None, logprobs: int | None = None,
                            constraint: Constraint | list[Constraint | None] | None = None,
                            **shortcuts) -> Iterator[tuple[int, GenerationResult]]:
        """Decode many prompts, ``decode.batch_size`` rows at a time
        (`mtp_engine.decoder`), yielding ``(index, result)`` as rows finish.

        Args:
            prompts: Texts or token-id lists.
            max_tokens: One budget for all, or one per prompt.
            seed: One seed per prompt (a list), or one integer (prompt
                ``i`` then samples with seed ``seed + i``), or None (fresh
                random seeds). Each prompt's tokens equal `generate`'s with
                its seed, whatever the batch holds (exact sampler).
            prefix: A `prefill_prefix` result: the prompts that start with
                it prefill only the tokens after it (the others all theirs).
            constraint: One constraint for all, or one (or None) per prompt.
            decode, sampling, stop, logprobs, **shortcuts: As `generate`.

        Raises:
            ValueError/TypeError: Bad parameters or prompts (checked before
                anything is decoded).
        """
        budgets = max_tokens if isinstance(max_tokens, (list, tuple)) else [max_tokens] * len(prompts)
        if len(budgets) != len(prompts):
            raise ValueError(f"{len(budgets)} max_tokens for {len(prompts)} prompts")
        seeds = list(seed) if isinstance(seed, (list, tuple)) else [
            None if seed is None else seed + i for i in range(len(prompts))]
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        constraints = list(constraint) if isinstance(constraint, (list, tuple)) else [constraint] * len(prompts)
        if len(constraints) != len(prompts):
            raise ValueError(f"{len(constraints)} constraints for {len(prompts)} prompts")
        decode, values = self.configs(decode, sampling, **shortcuts)
        samples = [[make_sampling(**{**values, "seed": s})] for s in seeds]
        for (i, _), result in self._decode(prompts, decode, samples, budgets, stop, False, prefix, logprobs=logprobs,
                                           constraints=constraints):
            yield i, result

    def generate_batch(self, prompts: list[str | list[int]], **kwargs) -> list[GenerationResult]:
        """`generate_batch_iter`'s results, in input order."""
        return [result for _, result in sorted(self.generate_batch_iter(prompts, **kwargs), key=lambda row: row[0])]

    def _decode(self, prompts, decode: DecodeConfig, samples: list[list[SamplingParams]], budgets: list[int],
                stop, trace: bool, prefix: PrefixState | None = None, strict: bool = False, logprobs: int | None = None,
                constraints: list[Constraint | None] | None = None) -> Iterator[tuple[tuple[int, int], GenerationResult]]:
        """``((prompt, sample), result)`` as rows finish, one decoder for all;
        ``prefix`` serves the prompts that continue it (``strict``: every
        prompt must); ``constraints`` has one per prompt (None: none)."""
        decoder = Decoder(self, decode)
        for i, (prompt, params, budget, constraint) in enumerate(zip(prompts, samples, budgets,
                                                                     constraints or [None] * len(prompts))):
            start = prefix if strict or prefix is None or prefix.continues(self.encode(prompt)) else None
            decoder.add(i, prompt, params, max_tokens=budget, stop=stop, trace=trace, prefix=start, logprobs=logprobs,
                        constraint=constraint)
        try:
            while decoder.pending:
                yield from decoder.step()
        finally:
            decoder.close()

    def prefill(self, ids: list[int], caches: list, keep_hidden: bool,
                evaluate: bool = True) -> tuple[mx.array | None, mx.array]:
        """Feed the prompt as mlx-lm's ``generate_step`` does (chunks of all but
        the last token, then the last token alone): the same forwards, so the
        same arithmetic. Only a chunk that more chunks follow is evaluated on
        its own (and MLX's buffer cache emptied after it, bounding a long
        prompt's memory); the last chunk and the last token are evaluated
        together, so a short prompt costs one sync and leaves the buffers a
        running batch reuses (emptying them made its next step allocate
        anew). ``evaluate=False`` leaves that last evaluation to the caller
        (its first token's read-back then makes the prompt's only sync).

        Returns:
            ``(hidden, logits)``: the prompt's final-normed hiddens ``[1, n,
            dim]`` (None unless ``keep_hidden``) and the last position's
            logits ``[1, 1, vocab]``.
        """
        trunk = self.model.model
        prompt = mx.array(ids)
        hiddens = []
        while prompt.size > 1:
            n = min(self.prefill_step_size, prompt.size - 1)
            h = trunk(prompt[:n][None], cache=caches)
            if keep_hidden:
                hiddens.append(h)
            prompt = prompt[n:]
            if prompt.size > 1:
                mx.eval(h if keep_hidden else [], [c.state for c in caches])
                mx.clear_cache()
        h = trunk(prompt[None], cache=caches)
        logits = self.lm_head(h[:, -1:, :])
        hiddens.append(h)
        hidden = mx.concatenate(hiddens, axis=1) if keep_hidden else None
        if evaluate:
            mx.eval(logits, hidden) if keep_hidden else mx.eval(logits, [c.state for c in caches])
        return hidden, logits

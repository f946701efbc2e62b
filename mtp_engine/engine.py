"""The persistent MTP speculative decoding engine.

Contract: the engine knows nothing about files of jobs, shards or datasets.
It loads a checkpoint once and decodes prompts one at a time; every
`generate` call builds fresh caches, so nothing leaks between prompts.
Greedy speculative output equals plain greedy decoding of the same model.

One decoding step (chain): draft ``d_1..d_K`` from ``(H_last, x)`` with the MTP
head; verify ``[x, d_1..d_K]`` in one trunk forward that captures per-token
recurrent states; accept the longest prefix with ``d_j == g_{j-1}``; emit it and
the bonus ``g_n``; commit ``n + 1`` tokens to the trunk's caches; queue the
accepted pairs for the head.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from mtp_engine.batched import BatchedDecoder
from mtp_engine.cache.capture import make_main_cache
from mtp_engine.cache.ops import restore, snapshot
from mtp_engine.drafters.select import (
    DRAFTERS,
    EngineDrafters,
    build_drafters,
    select_drafter,
)
from mtp_engine.kernels import cpu_blas
from mtp_engine.model.family import language_model, lm_head_module
from mtp_engine.model.loader import LoadedCheckpoint, load_checkpoint
from mtp_engine.modes import DecodeConfig
from mtp_engine.options import (
    EngineOptions,
    FastPathStatus,
    apply_process_settings,
    cudnn_attention_on,
    is_cuda_backend,
)
from mtp_engine.projection import ProjectedDrafts, project_rows
from mtp_engine.sampling import GREEDY, SamplingParams, choose, make_sampling
from mtp_engine.stopping import Finisher, stop_list
from mtp_engine.verify import VerifyOutcome, top_logits, verify
from schemas.records import GenerationResult, GenerationStats, StepTrace


class PromptTooLongError(ValueError):
    """The prompt does not fit the model's context."""


class MTPEngine:
    """Loads a Qwen3-Next or Qwen3.5 checkpoint with its MTP head once; decodes prompts
    with lossless greedy speculative decoding.

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
        self.drafters: EngineDrafters = build_drafters(
            checkpoint.head, self.text.model.embed_tokens, self.lm_head, lm_head_module(self.model),
            prefill_step_size, self.options
        )
        self.fast_paths: list[FastPathStatus] = [self._blas_status(), *checkpoint.fast_paths,
                                                 *self.drafters.statuses, self._attention_status()]
        self._side_stream: mx.Stream | None = None  # made on first use: `side_stream`

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
            **switches: `EngineOptions` fields to change, e.g.
                ``compile_layers=False``.

        Raises:
            See `load_checkpoint`; ValueError for an unknown switch.
        """
        options = (options if options is not None else EngineOptions.from_env()).with_switches(**switches)
        return cls(load_checkpoint(path, dtype=dtype, options=options), prefill_step_size=prefill_step_size)

    def _blas_status(self) -> FastPathStatus:
        if mx.default_device() != mx.cpu:
            return FastPathStatus("cpu_blas", "unavailable", "not MLX's CPU backend")
        why = cpu_blas.unavailable_reason()
        if why == cpu_blas.IMPORTED_TOO_LATE and self.options.cpu_blas:
            # The one way to lose the route by accident, and CPU decoding
            # runs several times slower without it.
            warnings.warn(f"cpu_blas fast path unavailable: {why} (CPU decoding runs several times slower)",
                          RuntimeWarning, stacklevel=4)  # the caller of MTPEngine.load
        if why is not None:
            state = "off" if why.startswith("off by") else "unavailable"
            return FastPathStatus("cpu_blas", state, why)
        route = cpu_blas.configure(self.options.cpu_blas, self.options.few_rows)
        if route == cpu_blas.BUNDLED:
            return FastPathStatus("cpu_blas", "off", "by choice: MLX's bundled BLAS (process-wide)")
        rows = f"products of <= {self.options.few_rows} rows in the few-row kernel, " if self.options.few_rows else ""
        return FastPathStatus("cpu_blas", "on", f"{rows}larger ones in OpenBLAS (process-wide)")

    def _attention_status(self) -> FastPathStatus:
        if not is_cuda_backend():
            return FastPathStatus("cudnn_attention", "unavailable", "not MLX's CUDA backend")
        on = cudnn_attention_on()
        return FastPathStatus("cudnn_attention", "on" if on else "off", "" if on else "by choice: MLX's own kernels")

    # -- model plumbing ------------------------------------------------------

    def lm_head(self, hidden: mx.array) -> mx.array:
        if self.text.args.tie_word_embeddings:
            return self.text.model.embed_tokens.as_linear(hidden)
        return self.text.lm_head(hidden)

    @property
    def quantized(self) -> bool:
        """Whether the trunk's linear layers are quantized (an ``mlx_lm.convert
        -q`` folder): on MLX's CPU backend their products cost every row
        again, so wider forwards do not come cheap (docs/BENCHMARKS.md)."""
        return any(isinstance(m, nn.QuantizedLinear) for _, m in self.text.named_modules())

    @property
    def eos_token_ids(self) -> set[int]:
        return set(self.tokenizer.eos_token_ids)

    @property
    def context_length(self) -> int:
        return self.checkpoint.context_length

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (a string is tokenized as is, no template)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return list(self.tokenizer.encode(prompt))
        if not isinstance(prompt, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise TypeError("prompt must be a string or a list of token ids (ints)")
        if not prompt:
            raise ValueError("prompt is empty")
        vocab = self.text.args.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        return list(prompt)

    def check_prompt(self, ids: list[int]) -> list[int]:
        """Raise `PromptTooLongError` unless ``ids`` leaves room to generate."""
        if len(ids) >= self.context_length:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens; the model's context is {self.context_length}"
            )
        return ids

    # -- generation ------------------------------------------------------------

    def generate(
        self,
        prompt: str | list[int],
        *,
        max_tokens: int = 256,
        mode: str = "chain",
        draft_tokens: int = 4,
        tau: float = 0.5,
        paths: int = 2,
        stop: str | list[str] | None = None,
        trace: bool = False,
        tree_pos2: bool = True,
        drafter: str = "auto",
        projection: ProjectedDrafts | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int | None = None,
        sampler: str = "exact",
    ) -> GenerationResult:
        """Decode one prompt: greedily, or sampling (`mtp_engine.sampling`).

        Args:
            prompt: Text (tokenized as is) or token ids.
            max_tokens: Most tokens to generate.
            mode: "baseline", "chain", "adaptive", "tree", "adaptive_tree"
                or "paths".
            draft_tokens: K, draft depth (maximum depth when adaptive).
            tau: Confidence threshold of the adaptive modes.
            paths: P, first-token candidates of "paths" mode.
            stop: Stop string(s); the text is cut before the first one.
            trace: Record every verify step in ``result.trace``.
            tree_pos2: "tree" mode adds the branch at draft position 2.
            drafter: Who drafts: "auto" (the fastest the engine has for the
                mode), "mlx", "mlx-eager" (the MLX head, not compiled),
                "cpp" (chain and adaptive) or "cuda" (chain); see
                `mtp_engine.drafters.select`. It changes speed, never the
                output.
            projection: Chain drafts replaced at an acceptance profile
                (benchmarks of random-weight models; `mtp_engine.projection`).
            temperature: 0 decodes greedily (the other sampling arguments
                are then ignored).
            top_p, top_k, min_p: Filters, in mlx-lm's order.
            seed: The completion's seed (None: a fresh random one, recorded
                in ``result.stats.seed``).
            sampler: "exact" (every mode emits plain sampling's tokens for
                the seed) or "rejection" (speculative sampling, lossless in
                distribution; chain and baseline modes).

        Returns:
            A `GenerationResult`.

        Raises:
            ValueError: Bad parameters, an empty prompt, or
                `PromptTooLongError` for a prompt over the context.
        """
        return self.generate_samples(
            prompt, seeds=[seed], max_tokens=max_tokens, mode=mode, draft_tokens=draft_tokens, tau=tau,
            paths=paths, stop=stop, trace=trace, tree_pos2=tree_pos2, drafter=drafter, projection=projection,
            temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, sampler=sampler)[0]

    def generate_samples(
        self,
        prompt: str | list[int],
        *,
        seeds: list[int | None],
        max_tokens: int = 256,
        mode: str = "chain",
        draft_tokens: int = 4,
        tau: float = 0.5,
        paths: int = 2,
        stop: str | list[str] | None = None,
        trace: bool = False,
        tree_pos2: bool = True,
        drafter: str = "auto",
        projection: ProjectedDrafts | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        sampler: str = "exact",
    ) -> list[GenerationResult]:
        """Several completions of one prompt, one per seed, sharing one
        prefill (its caches are restored before each completion). Each
        result equals `generate` with that seed. Arguments as `generate`."""
        spec = DecodeConfig(
            mode=mode, draft_tokens=draft_tokens, tau=tau, paths=paths, tree_pos2=tree_pos2
        )
        if not isinstance(seeds, (list, tuple)) or not seeds:
            raise ValueError(f"seeds must be a non-empty list, got {seeds!r}")
        samplings = [make_sampling(temperature, top_p, top_k, min_p, seed, sampler) for seed in seeds]
        first = samplings[0]
        if first.sampler == "rejection" and not first.greedy and spec.mode not in ("baseline", "chain"):
            raise ValueError(f"the rejection sampler drafts chains; mode {spec.mode!r} needs sampler='exact'")
        if drafter not in DRAFTERS and drafter != "c++":
            raise ValueError(f"drafter must be one of {', '.join(map(repr, DRAFTERS))}, got {drafter!r}")
        chosen = self.drafter_for(spec.mode, drafter, first) if spec.speculative else None
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
        stops = stop_list(stop)
        ids = self.check_prompt(self.encode(prompt))
        max_tokens = min(max_tokens, self.context_length - len(ids))

        t0 = time.perf_counter()
        caches = make_main_cache(self.model)
        prompt_hidden, logits = self.prefill(ids, caches, keep_hidden=spec.speculative)
        saved = snapshot(caches) if len(samplings) > 1 else None
        prefill_s = (time.perf_counter() - t0) / len(samplings)
        results = []
        for j, sampling in enumerate(samplings):
            t1 = time.perf_counter()
            if j:
                restore(caches, saved)
            x = int(choose(logits, [sampling], mx.zeros((1, 1), dtype=mx.int32)).item())  # generated position 0
            stats = GenerationStats(mode=spec.mode, prompt_tokens=len(ids), temperature=sampling.temperature,
                                    seed=None if sampling.greedy else sampling.seed, **spec.stats_params())
            stats.histogram = [0] * (spec.draft_tokens + 1) if spec.speculative else []
            stats.row_wins = [0] * spec.max_paths if spec.speculative else []
            finisher = Finisher(self.tokenizer, self.eos_token_ids, max_tokens, stops)
            steps: list[StepTrace] | None = [] if trace else None
            finisher.add([x])
            if not finisher.done:
                if spec.speculative:
                    self._speculate(spec, chosen, ids, prompt_hidden, x, caches, finisher, stats, steps, projection,
                                    sampling)
                else:
                    self._plain(x, caches, finisher, stats, sampling)
            stats.prefill_s = prefill_s
            stats.decode_s = time.perf_counter() - t1
            stats.generated_tokens = len(finisher.tokens)
            results.append(GenerationResult(
                tokens=finisher.tokens,
                text=finisher.text(),
                finish_reason=finisher.reason or "length",
                stats=stats,
                prompt_tokens=ids,
                trace=steps,
            ))
        return results

    def generate_batch_iter(
        self,
        prompts: list[str | list[int]],
        *,
        batch_size: int = 8,
        max_tokens: int | list[int] = 256,
        mode: str = "chain",
        draft_tokens: int = 3,
        stop: str | list[str] | None = None,
        drafter: str = "auto",
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int | list[int | None] | None = None,
        sampler: str = "exact",
        prefill_ahead: int = 0,
    ) -> Iterator[tuple[int, GenerationResult]]:
        """Decode many prompts with batched speculation (`mtp_engine.batched`),
        yielding ``(index, result)`` as rows finish.

        Args:
            prompts: Texts or token-id lists.
            batch_size: Most rows in flight; a finished row's place goes to
                the next prompt at once.
            max_tokens: One budget for all, or one per prompt.
            mode: "chain" (``draft_tokens`` drafts per row and step) or
                "baseline" (plain batched decoding).
            stop: Stop string(s) for every prompt.
            drafter: "auto", "mlx" or "cpp".
            temperature, top_p, top_k, min_p, sampler: Sampling, as
                `generate`, for every prompt.
            seed: One seed per prompt (a list), or one integer (prompt
                ``i`` then samples with seed ``seed + i``), or None (fresh
                random seeds). Each prompt's tokens equal `generate`'s with
                its seed, whatever the batch holds (exact sampler).
            prefill_ahead: Prefill the next N queued prompts on a second
                stream while the batch decodes (0: each when it joins).
                The tokens are the same either way; whether it is faster
                depends on the backend (docs/BENCHMARKS.md).

        Raises:
            ValueError/TypeError: Bad parameters or prompts (checked before
                anything is decoded).
        """
        budgets = max_tokens if isinstance(max_tokens, (list, tuple)) else [max_tokens] * len(prompts)
        if len(budgets) != len(prompts):
            raise ValueError(f"{len(budgets)} max_tokens for {len(prompts)} prompts")
        if isinstance(seed, (list, tuple)):
            seeds = list(seed)
        else:
            seeds = [None if seed is None else seed + i for i in range(len(prompts))]
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        params = [make_sampling(temperature, top_p, top_k, min_p, s, sampler) for s in seeds]
        decoder = BatchedDecoder(self, batch_size, mode, draft_tokens, drafter, prefill_ahead=prefill_ahead)
        for i, (prompt, budget) in enumerate(zip(prompts, budgets)):
            decoder.add(i, prompt, max_tokens=budget, stop=stop, sampling=params[i])
        try:
            while decoder.pending:
                yield from decoder.step()
        finally:
            decoder.close()

    def generate_batch(self, prompts: list[str | list[int]], **kwargs) -> list[GenerationResult]:
        """`generate_batch_iter`'s results, in input order."""
        results: list[GenerationResult | None] = [None] * len(prompts)
        for i, result in self.generate_batch_iter(prompts, **kwargs):
            results[i] = result
        return results

    def side_stream(self) -> mx.Stream:
        """The engine's second stream on its device (one per engine, made on
        first use): prefills dispatched ahead of a batch's steps run there."""
        if self._side_stream is None:
            self._side_stream = mx.new_stream(mx.default_device())
        return self._side_stream

    def prefill(self, ids: list[int], caches: list, keep_hidden: bool,
                stream: mx.Stream | None = None) -> tuple[mx.array | None, mx.array]:
        """Feed the prompt as mlx-lm's ``generate_step`` does (chunks of all but
        the last token, then the last token alone).

        Args:
            stream: Run the prompt on this stream and only dispatch it
                (``mx.async_eval``): the arrays returned are ready when read,
                and the caller's own stream is free meanwhile. None: the
                default stream, evaluated chunk by chunk before returning.

        Returns:
            ``(hidden, logits)``: the prompt's final-normed hiddens ``[1, n,
            dim]`` (None unless ``keep_hidden``) and the last position's
            logits ``[1, 1, vocab]``.
        """
        trunk = self.model.model
        run = mx.eval if stream is None else mx.async_eval
        with mx.stream(stream) if stream is not None else contextlib.nullcontext():
            prompt = mx.array(ids)
            hiddens = []
            while prompt.size > 1:
                n = min(self.prefill_step_size, prompt.size - 1)
                h = trunk(prompt[:n][None], cache=caches)
                if keep_hidden:
                    hiddens.append(h)
                run(h if keep_hidden else [], [c.state for c in caches])
                prompt = prompt[n:]
                if stream is None:
                    mx.clear_cache()
            h = trunk(prompt[None], cache=caches)
            logits = self.lm_head(h[:, -1:, :])
            hiddens.append(h)
            hidden = mx.concatenate(hiddens, axis=1) if keep_hidden else None
            run(logits, hidden) if keep_hidden else run(logits, [c.state for c in caches])
        return hidden, logits

    def _plain(self, x: int, caches: list, finisher: Finisher, stats: GenerationStats,
               sampling: SamplingParams = GREEDY) -> None:
        """Plain decoding (one token per forward), pipelined like mlx-lm's
        ``generate_step``."""
        model = self.model

        def step(token: mx.array, position: int) -> mx.array:
            logits = model(token.reshape(1, 1), cache=caches)[:, -1:, :]
            return choose(logits, [sampling], mx.array([[position]], dtype=mx.int32))

        position = len(finisher.tokens)  # the generated position of the token the next forward gives
        y = step(mx.array([x]), position)
        mx.async_eval(y)
        while True:
            # Queue the following token before reading this one, so the host
            # work overlaps the next forward.
            next_y = None
            position += 1
            if finisher.remaining > 1:
                next_y = step(y, position)
                mx.async_eval(next_y)
            stats.steps += 1
            finisher.add([int(y.item())])
            if finisher.done:
                return
            y = next_y
            if stats.steps % 256 == 0:
                mx.clear_cache()

    def drafter_for(self, mode: str, choice: str = "auto", sampling: SamplingParams = GREEDY):
        """The drafter a mode uses (`mtp_engine.drafters.select.select_drafter`)."""
        return select_drafter(self.drafters, mode, choice, sampling)

    def _speculate(self, spec, drafter, ids, prompt_hidden, x, caches, finisher, stats, steps,
                   projection: ProjectedDrafts | None = None, sampling: SamplingParams = GREEDY) -> None:
        state = drafter.new_state()
        if not sampling.greedy:
            state.sampling = sampling
        rejection = sampling.sampler == "rejection" and not sampling.greedy
        # Pairs (H_0, t_1) .. (H_{n-1}, x): the prompt's MTP prefill and the
        # first draft's input, consumed by the first draft forward.
        drafter.set_pending(state, prompt_hidden, ids[1:] + [x])
        while True:
            # Never draft past max_tokens: with one token left, verify x alone.
            depth = finisher.remaining - 1
            t0 = time.perf_counter()
            start = len(finisher.tokens)  # the generated position verify column 0 predicts
            if not sampling.greedy:
                state.position = start
            drafted = spec.propose(drafter, state, depth) if depth >= 1 else [[]]
            if projection is not None and depth >= 1:
                if isinstance(drafted, mx.array):  # [P, K], lazy: its shape, not a row of it
                    projected = projection.drafts(drafted.shape[1], len(finisher.tokens))
                    drafted = project_rows(drafted, [projected] + [None] * (drafted.shape[0] - 1))
                else:
                    drafted = [projection.drafts(len(drafted[0]), len(finisher.tokens))] + drafted[1:]
            t1 = time.perf_counter()
            q_scaled = mx.concatenate(state.q_scaled)[None] if rejection and depth >= 1 else None
            out = self._verify(caches, x, drafted, sampling, start, q_scaled)
            drafted = out.paths
            stats.draft_s += t1 - t0
            stats.verify_s += time.perf_counter() - t1
            stats.steps += 1
            stats.drafted += len(drafted[out.row])
            stats.accepted += out.accepted
            stats.histogram[out.accepted] += 1
            stats.row_wins[out.row] += 1
            stats.rescued += out.row > 0
            if steps is not None:
                steps.append(StepTrace(drafted, out.accepted, out.row, out.emitted, top_logits(out.logits)))
            finisher.add(out.emitted)
            if finisher.done:
                return
            drafter.commit(state, out.hidden, out.emitted, row=out.row)
            x = out.emitted[-1]

    def _verify(self, caches: list, x: int, paths: list[list[int]] | mx.array, sampling: SamplingParams = GREEDY,
                start: int = 0, q_scaled: mx.array | None = None) -> VerifyOutcome:
        return verify(self.model.model, self.lm_head, caches, x, paths, self.options.state_capture, sampling, start,
                      q_scaled)

"""The persistent MTP speculative decoding engine.

Contract: the engine knows nothing about files of jobs, shards or datasets.
It loads a checkpoint once and decodes prompts one at a time; every
`generate` call builds fresh caches, so nothing leaks between prompts.
Greedy speculative output equals plain greedy decoding of the same model.

One decoding step (chain): draft ``d_1..d_K`` from ``(H_last, x)`` with the MTP
head; verify ``[x, d_1..d_K]`` in one trunk forward with per-token recurrent
checkpoints; accept the longest prefix with ``d_j == g_{j-1}``; emit it and
the bonus ``g_n``; commit ``n + 1`` tokens to the trunk's caches; queue the
accepted pairs for the head.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from mtp_engine.cache_ops import (
    commit_by_replay,
    commit_tree_row,
    commit_verified_prefix,
    snapshot,
    tile_caches,
)
from mtp_engine.compiled_head import can_compile_head
from mtp_engine.cpu_drafter import NativeDrafter, native_head
from mtp_engine.cuda_drafter import KernelDrafter, chain_kernel
from mtp_engine.drafter import MTPDrafter
from mtp_engine.loader import LoadedCheckpoint, load_checkpoint
from mtp_engine.modes import DecodeConfig
from mtp_engine.recurrent import CheckpointArraysCache, make_main_cache
from mtp_engine.stopping import Finisher, stop_list
from schemas.records import GenerationResult, GenerationStats, StepTrace


DRAFTERS = ("auto", "mlx", "mlx-eager", "c++", "cuda")
"""Who may draft a generation's chain and adaptive modes (`MTPEngine.generate`)."""


class PromptTooLongError(ValueError):
    """The prompt does not fit the model's context."""


@dataclass(frozen=True)
class VerifyOutcome:
    """Result of one verify forward.

    Attributes:
        row: Winning row (path index).
        accepted: Drafts accepted on that row (n).
        emitted: ``d_1..d_n`` and the bonus token.
        hidden: The verify forward's trunk hiddens, every row, ``[P, K+1, dim]``;
            positions ``0..n`` of ``row`` are the committed ones.
        logits: That row's logits at positions ``0..n``, ``[n+1, vocab]`` (lazy).
        paths: The drafted paths that were verified, as token lists.
    """

    row: int
    accepted: int
    emitted: list[int]
    hidden: mx.array
    logits: mx.array
    paths: list[list[int]]


def top_logits(logits: mx.array, k: int = 4) -> list[list[tuple[int, float]]]:
    """The ``k`` highest ``(token, logit)`` pairs of each row of ``[n, vocab]``
    logits, best first (float32 values)."""
    order = mx.argsort(-logits.astype(mx.float32), axis=-1)[:, :k]
    values = mx.take_along_axis(logits, order, axis=-1).astype(mx.float32)
    return [list(zip(t, v)) for t, v in zip(order.tolist(), values.tolist())]


def greedy_tokens(logits: mx.array) -> mx.array:
    """Greedy choice as mlx-lm's ``generate_step`` makes it (argmax of the
    log-probabilities), so rounding ties resolve identically."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return mx.argmax(logprobs, axis=-1)


def accepted_prefix(draft: list[int], targets: list[int]) -> int:
    """Length of the longest prefix with ``draft[j] == targets[j]``."""
    n = 0
    for d, g in zip(draft, targets):
        if d != g:
            break
        n += 1
    return n


class MTPEngine:
    """Loads a Qwen3-Next checkpoint with its MTP head once; decodes prompts
    with lossless greedy speculative decoding.

    Args:
        checkpoint: What `load_checkpoint` returned.
        use_checkpoints: Commit recurrent caches from per-token checkpoints
            (default). False restores a snapshot and replays the accepted
            tokens instead (slower; for caches without checkpoints).
        prefill_step_size: Prompt tokens per prefill forward (as mlx-lm).
        host_drafts: On a GPU, draft chain and adaptive modes on the host
            CPU with the C++ head (float32 copies of the head, embedding and
            LM head in host memory) while the GPU verifies. On the CPU
            backend the C++ head is used whenever it can run the head.
        compile_head: Draft through a `CompiledHead` (the head's forward
            compiled around its KV-cache attention). Default: whenever the
            head allows it (`can_compile_head`).
        draft_kernel: On CUDA, draft chains with one kernel launch each
            (`mtp_engine.cuda_drafter`). Default: wherever the kernel can
            serve the head; False never.
    """

    def __init__(
        self,
        checkpoint: LoadedCheckpoint,
        *,
        use_checkpoints: bool = True,
        prefill_step_size: int = 2048,
        host_drafts: bool = False,
        compile_head: bool | None = None,
        draft_kernel: bool | None = None,
    ):
        self.checkpoint = checkpoint
        self.model = checkpoint.model
        # Inference mode, as mlx_lm.load leaves a model: the engine's own
        # recurrence serves only layers that are not training (a model left
        # training would decode the same tokens through mlx-lm's per-token ops).
        self.model.eval()
        checkpoint.head.eval()
        self.tokenizer = checkpoint.tokenizer
        self.config = checkpoint.config
        self.use_checkpoints = use_checkpoints
        self.prefill_step_size = prefill_step_size
        trunk = self.model.model
        if compile_head is None:
            compile_head = can_compile_head(checkpoint.head)
        self.drafter = MTPDrafter(
            checkpoint.head, trunk.embed_tokens, self.lm_head, prefill_step_size, compiled=compile_head
        )
        # The same head, never compiled (drafter="mlx-eager": for comparisons).
        self.eager_drafter = (
            MTPDrafter(checkpoint.head, trunk.embed_tokens, self.lm_head, prefill_step_size)
            if compile_head
            else self.drafter
        )
        # On the CPU, chain and adaptive drafts run in C++ where the head allows
        # (`mtp_engine.cpu_drafter`); it reads the head's weights as they are now.
        lm_head = trunk.embed_tokens if self.model.args.tie_word_embeddings else self.model.lm_head
        native = native_head(checkpoint.head, trunk.embed_tokens, lm_head, on_gpu=host_drafts)
        self.native_drafter = NativeDrafter(native) if native is not None else None
        # On CUDA, chain drafts run as one kernel launch where it serves the head.
        kernel = chain_kernel(checkpoint.head, trunk.embed_tokens, lm_head) if draft_kernel is not False else None
        self.kernel_drafter = (
            KernelDrafter(checkpoint.head, trunk.embed_tokens, self.lm_head, kernel, prefill_step_size)
            if kernel is not None
            else None
        )

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        dtype: str | None = None,
        compile_layers: bool | None = None,
        rowwise_linears: bool | None = None,
        **kwargs,
    ) -> "MTPEngine":
        """Load a checkpoint folder (Hub layout, or mlx_lm.convert output that
        holds the ``mtp.*`` tensors). ``dtype`` casts the weights ("float32",
        "bfloat16", "float16"); ``compile_layers`` turns compiled decoder
        layers on or off (default: on MLX's CPU backend only);
        ``rowwise_linears`` few-row dense products row by row (default: on
        CUDA). See `load_checkpoint` for errors."""
        checkpoint = load_checkpoint(
            path, dtype=dtype, compile_layers=compile_layers, rowwise_linears=rowwise_linears
        )
        return cls(checkpoint, **kwargs)

    # -- model plumbing ------------------------------------------------------

    def lm_head(self, hidden: mx.array) -> mx.array:
        if self.model.args.tie_word_embeddings:
            return self.model.model.embed_tokens.as_linear(hidden)
        return self.model.lm_head(hidden)

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
        vocab = self.model.args.vocab_size
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
    ) -> GenerationResult:
        """Decode one prompt greedily.

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
            drafter: Who drafts chain and adaptive modes: "auto" (the C++
                head or the CUDA chain kernel where the engine has them, see
                `drafter_for`), "mlx", "mlx-eager" (the MLX head, not
                compiled, in every mode), "c++" or "cuda" (chains only). It
                changes speed, never the output.

        Returns:
            A `GenerationResult`.

        Raises:
            ValueError: Bad parameters, an empty prompt, or
                `PromptTooLongError` for a prompt over the context.
        """
        spec = DecodeConfig(
            mode=mode, draft_tokens=draft_tokens, tau=tau, paths=paths, tree_pos2=tree_pos2
        )
        if drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {', '.join(map(repr, DRAFTERS))}, got {drafter!r}")
        chosen = self.drafter_for(spec.mode, drafter) if spec.speculative else None
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
        stops = stop_list(stop)
        ids = self.check_prompt(self.encode(prompt))
        max_tokens = min(max_tokens, self.context_length - len(ids))

        stats = GenerationStats(mode=spec.mode, prompt_tokens=len(ids), **spec.stats_params())
        stats.histogram = [0] * (spec.draft_tokens + 1) if spec.speculative else []
        stats.row_wins = [0] * spec.max_paths if spec.speculative else []
        finisher = Finisher(self.tokenizer, self.eos_token_ids, max_tokens, stops)
        steps: list[StepTrace] | None = [] if trace else None

        t0 = time.perf_counter()
        caches = make_main_cache(self.model)
        if spec.speculative:
            prompt_hidden, x = self._prefill(ids, caches, keep_hidden=True)
        else:
            _, x = self._prefill(ids, caches, keep_hidden=False)
        t1 = time.perf_counter()
        finisher.add([x])
        if not finisher.done:
            if spec.speculative:
                self._speculate(spec, chosen, ids, prompt_hidden, x, caches, finisher, stats, steps)
            else:
                self._plain(x, caches, finisher, stats)
        t2 = time.perf_counter()

        stats.prefill_s = t1 - t0
        stats.decode_s = t2 - t1
        stats.generated_tokens = len(finisher.tokens)
        return GenerationResult(
            tokens=finisher.tokens,
            text=finisher.text(),
            finish_reason=finisher.reason or "length",
            stats=stats,
            prompt_tokens=ids,
            trace=steps,
        )

    def _prefill(self, ids: list[int], caches: list, keep_hidden: bool):
        """Feed the prompt as mlx-lm's ``generate_step`` does (chunks of all but
        the last token, then the last token alone).

        Returns:
            ``(hidden, x)``: the prompt's final-normed hiddens ``[1, n, dim]``
            (None unless ``keep_hidden``) and the first generated token.
        """
        trunk = self.model.model
        prompt = mx.array(ids)
        hiddens = []
        while prompt.size > 1:
            n = min(self.prefill_step_size, prompt.size - 1)
            h = trunk(prompt[:n][None], cache=caches)
            if keep_hidden:
                hiddens.append(h)
                mx.eval(h, [c.state for c in caches])
            else:
                mx.eval([c.state for c in caches])
            prompt = prompt[n:]
            mx.clear_cache()
        h = trunk(prompt[None], cache=caches)
        x = greedy_tokens(self.lm_head(h[:, -1, :]))
        hiddens.append(h)
        hidden = mx.concatenate(hiddens, axis=1) if keep_hidden else None
        mx.eval(x, hidden) if keep_hidden else mx.eval(x)
        return hidden, int(x.item())

    def _plain(self, x: int, caches: list, finisher: Finisher, stats: GenerationStats) -> None:
        """Plain greedy decoding, pipelined like mlx-lm's ``generate_step``."""
        model = self.model

        def step(token: mx.array) -> mx.array:
            return greedy_tokens(model(token.reshape(1, 1), cache=caches)[:, -1, :])

        y = step(mx.array([x]))
        mx.async_eval(y)
        while True:
            # Queue the following token before reading this one, so the host
            # work overlaps the next forward.
            next_y = None
            if finisher.remaining > 1:
                next_y = step(y)
                mx.async_eval(next_y)
            stats.steps += 1
            finisher.add([int(y.item())])
            if finisher.done:
                return
            y = next_y
            if stats.steps % 256 == 0:
                mx.clear_cache()

    def drafter_for(self, mode: str, choice: str = "auto") -> MTPDrafter | NativeDrafter:
        """The drafter a mode uses. "auto": the C++ one for chain and
        adaptive drafts when the engine has it, else the CUDA chain kernel
        for chains when the engine has it, else the MLX one; "mlx";
        "mlx-eager" (the MLX head without `CompiledHead`); "c++" and "cuda"
        (a ValueError where the engine has none or the mode is not one they
        draft)."""
        native_ok = self.native_drafter is not None and mode in ("chain", "adaptive")
        kernel_ok = self.kernel_drafter is not None and mode == "chain"
        if choice == "auto":
            if native_ok:
                return self.native_drafter
            return self.kernel_drafter if kernel_ok else self.drafter
        if choice == "mlx":
            return self.drafter
        if choice == "mlx-eager":
            return self.eager_drafter
        if choice == "c++":
            if not native_ok:
                raise ValueError(
                    f"no C++ drafter for mode {mode!r}: it drafts chain and adaptive modes on the CPU "
                    "backend (or with host_drafts=True) when the _mtp_draft extension is built"
                )
            return self.native_drafter
        if choice == "cuda":
            if not kernel_ok:
                raise ValueError(
                    f"no cuda chain kernel for mode {mode!r}: it drafts chain mode on MLX's CUDA backend "
                    "for one-layer MoE heads of unquantized weights (mtp_engine.cuda_drafter)"
                )
            return self.kernel_drafter
        raise ValueError(f"drafter must be one of {', '.join(map(repr, DRAFTERS))}, got {choice!r}")

    def _speculate(self, spec, drafter, ids, prompt_hidden, x, caches, finisher, stats, steps) -> None:
        state = drafter.new_state()
        # Pairs (H_0, t_1) .. (H_{n-1}, x): the prompt's MTP prefill and the
        # first draft's input, consumed by the first draft forward.
        drafter.set_pending(state, prompt_hidden, ids[1:] + [x])
        while True:
            # Never draft past max_tokens: with one token left, verify x alone.
            depth = finisher.remaining - 1
            t0 = time.perf_counter()
            drafted = spec.propose(drafter, state, depth) if depth >= 1 else [[]]
            t1 = time.perf_counter()
            out = self._verify(caches, x, drafted)
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

    def _verify(self, caches: list, x: int, paths: list[list[int]] | mx.array) -> VerifyOutcome:
        """One trunk forward over ``[x, path]`` for every path; commit the
        winning row's accepted prefix.

        ``paths`` are equal-length token lists, or the drafts as a lazy
        ``[P, K]`` int32 array (read back here, with the targets)."""
        drafts = paths if isinstance(paths, mx.array) else mx.array(paths, dtype=mx.int32)
        n_paths, width = drafts.shape[0], drafts.shape[1] + 1
        snaps = None if self.use_checkpoints else snapshot(caches)
        if n_paths > 1:
            tile_caches(caches, n_paths)
        if self.use_checkpoints:
            for c in caches:
                if isinstance(c, CheckpointArraysCache):
                    c.begin_capture()
        inputs = mx.concatenate([mx.full((n_paths, 1), x, dtype=mx.int32), drafts], axis=1)  # [P, K+1]
        hidden = self.model.model(inputs, cache=caches)  # [P, K+1, dim]
        logits = self.lm_head(hidden)
        # Drafts and targets in one read: [P][K] and [P][K+1].
        rows = mx.concatenate([drafts, greedy_tokens(logits).astype(mx.int32)], axis=1).tolist()
        paths = [r[: width - 1] for r in rows]
        targets = [r[width - 1 :] for r in rows]

        best_row, best_n = 0, -1
        for r, (path, g) in enumerate(zip(paths, targets)):
            n = accepted_prefix(path, g)
            if n > best_n:
                best_row, best_n = r, n
        path, g = paths[best_row], targets[best_row]
        emitted = path[:best_n] + [g[best_n]]
        keep = best_n + 1

        if n_paths > 1:
            committed = commit_tree_row(caches, width, keep, best_row)
        else:
            committed = commit_verified_prefix(caches, width, keep)
        if not committed:
            commit_by_replay(self.model.model, caches, snaps, mx.array([[x] + path[:best_n]]))
            mx.eval([c.state for c in caches])
        return VerifyOutcome(
            best_row,
            best_n,
            emitted,
            hidden,
            logits[best_row, :keep],
            paths,
        )

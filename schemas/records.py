"""Result records of one generation.

The engine fills them; the job runner turns them into Arrow rows. Vocabulary
(the same everywhere): a *verify step* is one forward of the main model over
drafted tokens; *drafted* counts draft tokens proposed to it (of the row that
was committed), *accepted* those that matched greedy decoding, and the
*acceptance length* is the number of tokens emitted per verify step
(accepted drafts plus the bonus token).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    """Acceptance statistics and timings of one `generate` call.

    Attributes:
        mode: Decoding mode that produced the tokens.
        draft_tokens: K, the maximum draft depth (0 for baseline).
        paths: Number of candidate paths verified per step (1 for chains).
        tau: Confidence threshold of the adaptive modes, else None.
        steps: Verify steps (main-model forwards after prefill).
        drafted: Draft tokens proposed in the committed rows.
        accepted: Draft tokens accepted.
        histogram: ``histogram[n]`` counts steps that accepted n drafts.
        rescued: Steps won by a row other than the first (tree modes).
        row_wins: ``row_wins[r]`` counts steps won by row r (tree modes).
        depths: Mode "auto": ``depths[d]`` counts steps in which the row
            verified ``d`` drafts (0: plain steps), as the controller chose.
        prompt_tokens: Length of the prompt in tokens.
        generated_tokens: Tokens returned to the caller.
        prefill_s: Seconds spent on the prompt (first token included).
        decode_s: Seconds spent after the first token.
        draft_s: Part of ``decode_s`` spent drafting (MTP forwards).
        verify_s: Part of ``decode_s`` spent in verify forwards and commits.
        temperature: The sampling temperature (0: greedy).
        seed: The completion's seed when it sampled, else None.
    """

    mode: str
    draft_tokens: int = 0
    paths: int = 1
    tau: float | None = None
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    histogram: list[int] = field(default_factory=list)
    rescued: int = 0
    row_wins: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    temperature: float = 0.0
    seed: int | None = None

    def count_step(self, drafts: int, accepted: int, path: int = 0, draft_s: float = 0.0,
                   verify_s: float = 0.0) -> None:
        """Count a verify step in which the row's winning path (its
        ``path``-th) carried ``drafts`` drafts and ``accepted`` of them were
        accepted (a plain step: 0 and 0)."""
        self.steps += 1
        self.drafted += drafts
        self.accepted += accepted
        self.rescued += path > 0
        self.draft_s += draft_s
        self.verify_s += verify_s
        for counts, index in ((self.histogram, accepted), (self.row_wins, path), (self.depths, drafts)):
            if counts:
                counts[index] += 1

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per verify step (1.0 for plain decoding)."""
        if self.steps == 0:
            return 0.0
        return (self.accepted + self.steps) / self.steps

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second after the first token."""
        if self.decode_s <= 0 or self.generated_tokens <= 1:
            return 0.0
        return (self.generated_tokens - 1) / self.decode_s

    def to_dict(self) -> dict:
        d = asdict(self)
        d["acceptance_length"] = self.acceptance_length
        return d


@dataclass(frozen=True)
class StepTrace:
    """One verify step, for debugging acceptance.

    Attributes:
        drafts: Drafted token ids, one list per verified path.
        accepted: Drafts accepted on the winning row.
        row: Index of the winning row.
        emitted: Tokens this step emitted (accepted drafts plus the bonus).
        top_logits: For each emitted token, the verify forward's highest
            ``(token, logit)`` pairs at its position, best first, to compare
            with another decoding's logits.
    """

    drafts: list[list[int]]
    accepted: int
    row: int
    emitted: list[int]
    top_logits: list[list[tuple[int, float]]] | None = None


@dataclass
class GenerationResult:
    """Output of `MTPEngine.generate`.

    Attributes:
        tokens: Generated token ids (prompt and EOS excluded; a stop string's
            tokens are kept, the text is cut before it).
        text: Decoded completion.
        finish_reason: ``"stop"`` (EOS or stop string) or ``"length"``.
        stats: Acceptance statistics and timings.
        prompt_tokens: The prompt's token ids as decoded.
        trace: Per-step records when ``trace=True`` was passed, else None.
        logprobs: With ``logprobs=N``: each token's log-probability and its
            N likeliest alternatives, ``(logprob, [(token, logprob), ...])``
            (`mtp_engine.sampling.token_logprobs`), else None.
        note: Why the output falls short of what was asked, else None: a
            constrained row that ``max_tokens`` cut before its output
            matched the constraint (finish reason "length").
    """

    tokens: list[int]
    text: str
    finish_reason: str
    stats: GenerationStats
    prompt_tokens: list[int] = field(default_factory=list)
    trace: list[StepTrace] | None = None
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    note: str | None = None

"""When a generation ends: EOS ids, stop strings, the token budget."""

from __future__ import annotations


class Finisher:
    """Collects emitted tokens and decides when generation ends."""

    def __init__(self, tokenizer, eos: set[int], max_tokens: int, stop: list[str]):
        self.tokenizer = tokenizer
        self.eos = eos
        self.max_tokens = max_tokens
        self.stop = stop
        self.tokens: list[int] = []
        self.reason: str | None = None
        self._detok = tokenizer.detokenizer if stop else None
        if self._detok is not None:
            self._detok.reset()
        self._longest_stop = max((len(s) for s in stop), default=0)

    @property
    def done(self) -> bool:
        return self.reason is not None

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.tokens)

    def add(self, tokens: list[int]) -> None:
        for t in tokens:
            if self.done:
                return
            if t in self.eos:
                self.reason = "stop"
                return
            self.tokens.append(t)
            if self._detok is not None:
                before = len(self._detok.text)
                self._detok.add_token(t)
                text = self._detok.text
                window = text[max(0, before - self._longest_stop) :]
                if any(s in window for s in self.stop):
                    self.reason = "stop"
                    return
            if len(self.tokens) >= self.max_tokens:
                self.reason = "length"

    def text(self) -> str:
        text = self.tokenizer.decode(self.tokens)
        if self.stop:
            cuts = [i for s in self.stop if (i := text.find(s)) >= 0]
            if cuts:
                text = text[: min(cuts)]
        return text


def stop_list(stop) -> list[str]:
    """Validate stop strings: None, a string, or a list of non-empty strings."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise TypeError(f"stop must be a string or a list of strings, got {stop!r}")
    if any(s == "" for s in stop):
        raise ValueError("stop strings must not be empty")
    return list(stop)


def check_max_tokens(value) -> int:
    """``value`` if it is a token budget (a positive int), else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"max_tokens must be a positive integer, got {value!r}")
    return value

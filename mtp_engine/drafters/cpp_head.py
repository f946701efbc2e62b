"""Chain and adaptive drafts with the MTP head in C++, on the CPU.

On MLX's CPU backend each of a draft step's primitives costs a fixed dispatch
far above its arithmetic. ``_mtp_cpp_drafter`` (``native/cpp_drafter.cpp``,
built by ``make install``) runs the same arithmetic as plain loops over the
same float32 weights, which the MLX model keeps (nothing is copied). Drafts
only propose, so it need only draft the same tokens as the MLX head, not
match it bit for bit.

It serves chain and adaptive modes, greedy, when the model runs on the CPU in
float32 and the head has the layout it knows (`mtp_engine.model.head_weights`). On a GPU it is
opt-in (`EngineOptions.cpp_drafter_on_gpu`): the head then drafts on the
host CPU from float32 copies while the GPU verifies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from mtp_engine.drafters.base import Proposal
from mtp_engine.model.head_weights import FLOATS, UnsupportedHead, head_weights
from mtp_engine.kernels.extensions import load_extension, unavailable_reason
from mtp_engine.model.mtp_head import MTPHead

MODULE = "_mtp_cpp_drafter"


def extension():
    """The extension module, or None when it is not built."""
    return load_extension(MODULE)


def build_cpp_head(head: MTPHead, embed: nn.Module, lm_head: nn.Module, on_gpu: bool = False):
    """``(draft_head, None)``: a ``DraftHead`` of the extension for this head
    (on a GPU only with ``on_gpu``), or ``(None, why)`` when it cannot run here."""
    ext = extension()
    if ext is None:
        return None, unavailable_reason(MODULE)
    gpu = mx.default_device() != mx.cpu
    if gpu and not on_gpu:
        return None, "off on a GPU unless cpp_drafter_on_gpu (host drafts) is set"
    try:
        weights, values = head_weights(head, embed, lm_head, FLOATS if gpu else (mx.float32,))
    except UnsupportedHead as e:
        return None, f"the head is not one it runs: {e}"
    with mx.stream(mx.cpu):
        weights = {k: mx.contiguous(w.astype(mx.float32)) for k, w in weights.items()}
        mx.eval(list(weights.values()))
    config = ext.HeadConfig()
    for k, v in values.items():
        setattr(config, k, v)
    return ext.DraftHead(weights, config), None


@dataclass
class CppRow:
    """One row's C++ head session and the pairs it has not consumed."""

    session: object
    pending: list[tuple[mx.array, int, list[int]]] = field(default_factory=list)  # (hiddens, their row, tokens)
    base: int = 0

    def take_pending(self) -> tuple[mx.array, int, list[int]]:
        """The pending pairs (consumed by the next draft): ``(hiddens, row,
        tokens)``, token ``j`` paired with ``hiddens[row, j]``."""
        if not self.pending:
            raise RuntimeError("drafting needs pending pairs (add_row/commit)")
        if len(self.pending) == 1:
            hidden, row, tokens = self.pending[0]
        else:  # plain steps added pairs: one row of all of them
            hidden = mx.concatenate([h[r : r + 1, : len(t)] for h, r, t in self.pending], axis=1)
            row, tokens = 0, [x for _, _, t in self.pending for x in t]
        self.base += len(tokens)
        self.pending = []
        return hidden, row, tokens


class CppDrafter:
    """Chain and adaptive drafts with the C++ head, one session per row (the
    `mtp_engine.drafters.base.Drafter` interface; greedy only)."""

    name = "cpp"
    modes = frozenset({"auto", "chain", "adaptive"})

    def __init__(self, head):
        self.head = head
        self.states: list[CppRow] = []

    @property
    def rows(self) -> int:
        return len(self.states)

    def add_row(self, slot: int | None, prompt_hidden: mx.array, pairs: list[int], key=None, prefix=None) -> None:
        """A joining row: the C++ head reads its prompt's pairs straight from
        ``prompt_hidden`` in its first draft, those a `PrefixState` ``prefix``
        covers from a copy of its session."""
        if prompt_hidden.shape[1] < len(pairs):
            raise ValueError(f"{prompt_hidden.shape[1]} hiddens for {len(pairs)} tokens")
        start = prefix.head_session if prefix is not None else None
        done = start.offset if start is not None else 0
        row = CppRow(start.copy() if start is not None else self.head.session(),
                     [(prompt_hidden[:, done:], 0, list(pairs[done:]))], done)
        if slot is None:
            self.states.append(row)
        else:
            self.states[slot] = row

    def filter(self, rows: list[int]) -> None:
        self.states = [self.states[r] for r in rows]

    def extend(self, hidden: mx.array, tokens: list[list[int]]) -> None:
        for b, (state, t) in enumerate(zip(self.states, tokens)):
            if t:
                state.pending.append((hidden, b, list(t)))

    def propose(self, decode, k: int, params, starts, caps) -> Proposal:
        """Greedy chains of ``k`` drafts for every row together (each
        product of the head takes all rows at once: a weight is read once per
        tile of rows), or adaptive chains row by row. Chains are lazy on the
        CPU backend: evaluated on MLX's CPU stream (the C++ head runs there)
        while the host builds the verify forward on top of them."""
        if not all(p.greedy for p in params):
            raise ValueError("the C++ drafter drafts greedily; sampling drafts with the MLX head")
        if k < 1:
            raise ValueError(f"a draft needs k >= 1 tokens, got {k}")
        if decode.mode == "adaptive":
            chains = []
            for state, cap in zip(self.states, caps):  # a row at its budget still consumes its pairs
                hidden, row, tokens = state.take_pending()
                chains.append(state.session.draft(hidden, tokens, max(1, min(k, cap)), decode.tau, row)[0])
            return Proposal.padded(chains, caps)
        hiddens, sources, rows, tokens = {}, [], [], []  # hiddens: each array once, by identity
        for state in self.states:
            hidden, row, pairs = state.take_pending()
            sources.append(hiddens.setdefault(id(hidden), (len(hiddens), hidden))[0])
            rows.append(row)
            tokens.append(pairs)
        sessions = [s.session for s in self.states]
        drafts = extension().draft_batch(sessions, [h for _, h in hiddens.values()], sources, rows, tokens, k)
        if mx.default_device() != mx.cpu:
            # Host drafts for a GPU model are drafted at once: a verify on the
            # GPU waiting on an array of the CPU stream hung on MLX 0.32.4's
            # CUDA backend.
            drafts = mx.array(drafts.tolist(), dtype=mx.int32)
        else:
            mx.async_eval(drafts)
        return Proposal(drafts, uses=caps)

    def commit(self, hidden: mx.array, emitted: list[list[int]], winners: list[int]) -> None:
        for state, tokens, row in zip(self.states, emitted, winners):
            state.session.rewind(state.base)
            state.pending = [(hidden, row, list(tokens))]

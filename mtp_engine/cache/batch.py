"""Caches for a batch of rows that speculate together.

In a batched verify forward every row feeds ``K+1`` inputs and keeps its
own accepted prefix:

- `BatchKVCache` (attention layers, the MTP head): every row writes a
  forward's entries at the same buffer index. After the verify, each row
  keeps a prefix of them; the rest become *holes*, masked for every later
  query, and RoPE positions are per row (the count of a row's valid
  entries). No row's keys are ever moved or replayed. A suffix rejected by
  every row is trimmed, so a batch of one never has holes.
- `StateCaptureCache` (gated-delta layers): `commit_rows` takes, per row,
  the state captured after that row's last accepted input (one gather).

Rows join (`append_row`, or `replace_row` in the place of one that left,
writing only its own slice) after their own prefill and leave
(`filter_rows`) between steps.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from mtp_engine.cache.capture import StateCaptureCache, state_rows


class BatchKVCache:
    """An attention layer's keys and values for a batch of ragged rows.

    Attributes:
        keys, values: ``[B, heads, capacity, head_dim]`` buffers (None while empty).
        valid: ``[B, capacity]`` bool: which written entries each row attends.
        idx: Entries written so far (every row writes at the same index).
        positions: Each row's next RoPE position (its valid entries).
        holes: Whether any entry below ``idx`` is invalid for some row.
    """

    step = 256

    def __init__(self, batch: int = 0):
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.valid: mx.array | None = None
        self.idx = 0
        self.positions: list[int] = [0] * batch
        self.holes = False

    # -- the KVCache protocol mlx-lm's attention uses ---------------------

    @property
    def offset(self) -> int | mx.array:
        """The RoPE offset of the next forward's first input: one int when
        every row is at the same position (a batch of one always is: RoPE
        variants that take no array offset run there), else per row, ``[B]``
        (`host_array`: every layer of a forward shares one)."""
        first = self.positions[0] if self.positions else 0
        if all(p == first for p in self.positions):
            return first
        return host_array(tuple(self.positions))

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """The attention mask of the next forward over ``N`` inputs per row:
        ``[B, 1, N, idx + N]`` bool (earlier entries where valid, the new
        ones causally), or "causal" / None where no row has a hole."""
        if window_size is not None:
            raise ValueError("BatchKVCache has no sliding window")
        if not self.holes and not return_array:
            return "causal" if N > 1 else None
        B = len(self.positions)
        causal = mx.tril(mx.ones((N, N), dtype=mx.bool_))
        block = mx.broadcast_to(causal[None, None], (B, 1, N, N))
        if self.idx == 0:
            return block
        old = mx.broadcast_to(self.valid[:, None, None, : self.idx], (B, 1, N, self.idx))
        return mx.concatenate([old, block], axis=-1)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write ``[B, heads, N, dim]`` new entries at ``idx`` (valid until
        `settle` says otherwise) and return every row's entries so far."""
        n = keys.shape[2]
        if self.keys is None:
            self._start(keys, values)
        if self.idx + n > self.keys.shape[2]:
            self._pad(entries=(n + self.step - 1) // self.step * self.step)
        self.keys[..., self.idx : self.idx + n, :] = keys
        self.values[..., self.idx : self.idx + n, :] = values
        self.valid[:, self.idx : self.idx + n] = True
        self.idx += n
        self.positions = [p + n for p in self.positions]
        return self.keys[..., : self.idx, :], self.values[..., : self.idx, :]

    def _start(self, keys: mx.array, values: mx.array) -> None:
        """Empty buffers for every row, of ``keys``/``values``' heads, widths and dtypes."""
        B, heads = len(self.positions), keys.shape[1]
        self.keys = mx.zeros((B, heads, 0, keys.shape[3]), keys.dtype)
        self.values = mx.zeros((B, heads, 0, values.shape[3]), values.dtype)
        self.valid = mx.zeros((B, 0), dtype=mx.bool_)

    def _pad(self, rows: int = 0, entries: int = 0) -> None:
        """Keep the ``idx`` entries written so far, plus zeros: ``rows`` more
        rows (all holes) or ``entries`` more entries (not yet valid)."""
        widths = [(0, rows), (0, 0), (0, entries), (0, 0)]
        self.keys = mx.pad(self.keys[..., : self.idx, :], widths)
        self.values = mx.pad(self.values[..., : self.idx, :], widths)
        self.valid = mx.pad(self.valid[:, : self.idx], widths[::2])

    @property
    def state(self):
        return self.keys, self.values, self.valid

    def is_trimmable(self) -> bool:
        return False  # rows keep different prefixes: see `settle`

    @property
    def batch_size(self) -> int:
        return len(self.positions)

    # -- speculation -------------------------------------------------------

    def settle(self, keep: list[int], width: int) -> None:
        """After a forward over ``width`` inputs per row, row ``b`` keeps the
        first ``keep[b]`` of them; the others become holes. A suffix no row
        keeps is trimmed instead."""
        assert len(keep) == len(self.positions) and all(0 <= k <= width for k in keep), (keep, width)
        self.positions = [p - width + k for p, k in zip(self.positions, keep)]
        trimmed = width - max(keep, default=width)
        self.idx -= trimmed
        width -= trimmed
        if all(k == width for k in keep):
            return
        start = self.idx - width
        self.valid[:, start : self.idx] = mx.arange(width)[None] < host_array(tuple(keep))[:, None]
        self.holes = True

    def rewind(self, idx: int, positions: list[int]) -> None:
        """Forget every entry from ``idx`` on (what drafting wrote)."""
        assert 0 <= idx <= self.idx, (idx, self.idx)
        self.idx = idx
        self.positions = list(positions)

    # -- rows joining and leaving -------------------------------------------

    def add_row(self, keys: mx.array | None, values: mx.array | None, length: int) -> None:
        """Append a row whose ``length`` entries are ``keys``/``values``
        ``[1, heads, >= length, dim]`` (a prefilled batch-of-one cache): a row
        of holes, then filled as `replace_row` fills one."""
        self.positions.append(0)
        if self.keys is not None:
            self._pad(rows=1)
        self.replace_row(len(self.positions) - 1, keys, values, length)

    def replace_row(self, row: int, keys: mx.array | None, values: mx.array | None, length: int) -> None:
        """Put a prefilled row (as `add_row` takes it) in place of row
        ``row``, one that left: its entries end at ``idx`` like every row's
        (if it is longer than ``idx``, the others get holes in front of
        theirs), and the old row's all become holes. Only that row's slice
        is written, where `filter` and `add_row` would copy every row."""
        assert 0 <= row < len(self.positions), (row, len(self.positions))
        if keys is None:  # a row with no entries yet
            length = 0
        elif length:
            keys, values = keys[..., :length, :], values[..., :length, :]
            if length > self.idx:  # the write index moves up to ``length``: the other rows start with a gap
                if self.keys is None:
                    self._start(keys, values)
                self._pad(entries=length - self.idx)
                self.idx = length
                self.holes = self.holes or len(self.positions) > 1
            start = self.idx - length
            self.keys[row : row + 1, :, start : self.idx, :] = keys.astype(self.keys.dtype)
            self.values[row : row + 1, :, start : self.idx, :] = values.astype(self.values.dtype)
        pad = self.idx - length
        if self.valid is not None:
            self.valid[row : row + 1, : self.idx] = (mx.arange(self.idx) >= pad)[None]
        self.positions[row] = length
        if pad:
            self.holes = True

    def take(self, rows: list[int]) -> "BatchKVCache":
        """A new cache holding these rows (repeats allowed: a row per path
        of a draft tree); this one is unchanged."""
        out = BatchKVCache()
        out.idx, out.holes = self.idx, self.holes
        out.positions = [self.positions[r] for r in rows]
        if self.keys is not None:
            index = mx.array(rows, dtype=mx.int32)
            out.keys, out.values, out.valid = self.keys[index], self.values[index], self.valid[index]
        return out

    def filter(self, rows: list[int]) -> None:
        """Keep only these rows, in this order (`filter_rows` then trims leading holes)."""
        kept = self.take(rows) if rows else BatchKVCache()
        self.keys, self.values, self.valid = kept.keys, kept.values, kept.valid
        self.idx, self.positions, self.holes = kept.idx, kept.positions, kept.holes


@lru_cache(maxsize=8)
def host_array(values: tuple[int, ...]) -> mx.array:
    """``values`` as an int32 array, made once for every layer's cache in a
    forward (docs/BACKENDS.md, "Tuning constants"). Shared, so nothing may
    update one in place (``+=`` or a slice assignment on it)."""
    return mx.array(values, dtype=mx.int32)


def commit_rows(caches: list, width: int, keep: list[int]) -> None:
    """After a batched verify forward over ``width`` inputs per row, row
    ``b`` keeps its first ``keep[b]`` inputs in every cache: attention
    caches settle (holes for the rest), recurrent caches take the state
    captured after input ``keep[b] - 1`` of that row."""
    if any(not 1 <= k <= width for k in keep):
        raise ValueError(f"keep counts must be in 1..{width}, got {keep}")
    every = all(k == width for k in keep)
    # Each row's last kept input: one token for all rows, or one array for every layer's per-row gathers.
    last = keep[0] - 1 if len(set(keep)) == 1 else mx.array([k - 1 for k in keep], dtype=mx.int32)
    for c in caches:
        if isinstance(c, BatchKVCache):
            c.settle(keep, width)
            continue
        if not isinstance(c, StateCaptureCache):
            raise TypeError(f"unsupported cache type {type(c).__name__} in a batch")
        if not every:  # else the forward left each row's state after its last input
            captured = c.captured
            if captured is None:
                raise ValueError("the last forward captured no states (begin_capture before the verify)")
            c.cache = list(captured[last]) if isinstance(last, int) else [
                state_rows(captured.conv_states, last), state_rows(captured.ssm_states, last)]
        c.clear_captured()


def make_batch_cache(model) -> list:
    """Empty caches (no rows yet) for a batch through the trunk ``model``."""
    return [StateCaptureCache(2) if layer.is_linear else BatchKVCache() for layer in model.layers]


def append_row(batch: list, row: list, rows_before: int) -> None:
    """Add one prefilled row (batch-of-one caches from `make_main_cache`) to
    the batch's caches."""
    for b, r in zip(batch, row):
        if isinstance(b, BatchKVCache):
            b.add_row(r.keys, r.values, r.offset)
        elif rows_before == 0:
            b.cache = list(r.cache)
        else:
            b.cache = [mx.concatenate([x, y]) for x, y in zip(b.cache, r.cache)]


def replace_row(batch: list, row: list, slot: int) -> None:
    """Put one prefilled row (batch-of-one caches from `make_main_cache`)
    in place of row ``slot`` of the batch's caches, one that left."""
    for b, r in zip(batch, row):
        if isinstance(b, BatchKVCache):
            b.replace_row(slot, r.keys, r.values, r.offset)
        else:
            for x, y in zip(b.cache, r.cache):
                x[slot : slot + 1] = y
            b.clear_captured()


def trim_leading(batch: list, least: int = 1) -> None:
    """Drop the leading entries every row of an attention cache has as holes, where there are at
    least ``least`` (dropping copies every row's entries); two syncs for all the caches."""
    caches = [c for c in batch if isinstance(c, BatchKVCache) and c.keys is not None and c.idx]
    leads = [mx.argmax(mx.any(c.valid[:, : c.idx], axis=0)) for c in caches]
    mx.eval(leads)
    for c, lead in zip(caches, leads):
        lead = lead.item()
        if lead >= least:
            c.keys, c.values = c.keys[..., lead:, :], c.values[..., lead:, :]
            c.valid = c.valid[:, lead:]
            c.idx -= lead
    holes = [(~c.valid[:, : c.idx]).any() if c.idx else None for c in caches]
    mx.eval([h for h in holes if h is not None])
    for c, h in zip(caches, holes):
        c.holes = bool(h.item()) if h is not None else False


def filter_rows(batch: list, rows: list[int], trim: bool = True) -> None:
    """Keep only these rows of the batch's caches, in this order (repeats
    allowed); with ``trim``, attention caches drop leading entries no row
    attends."""
    index = mx.array(rows, dtype=mx.int32)
    for c in batch:
        if isinstance(c, BatchKVCache):
            c.filter(rows)
        else:
            c.cache = [x[index] if x is not None else None for x in c.cache] if rows else [None] * len(c.cache)
            c.clear_captured()
    if trim and rows:
        trim_leading(batch)

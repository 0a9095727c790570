"""Grammar masks frozen for one step, for engines whose other processes run the step from a pickled
SchedulerOutput (tensor / data / context parallel): only the driver holds and advances the requests'
RequestGrammar objects; every rank masks its logits from the rows computed here.

A FrozenGrammar offers the surface ModelRunner._constrain calls on a chunk's grammar:
`.backend.fill_bitmasks(grammars, out, rows)` (next-token masks) and `.fill_bitmasks_along(drafts, out)`
(a verify chunk's k + 1 masks along its drafts), answering with the rows the live grammar gave when the
step was frozen. Freezing is valid for a step whose grammars already hold every token before the step's
own (a synchronous step; not a step launched ahead whose masks wait for the step before it).
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from deepinfer.engine.outputs import SchedulerOutput


class FrozenBackend:
    """What `FrozenGrammar.backend` is: fills next-token masks of frozen grammars (live ones in the same
    list go to their own backend, in one call per backend)."""

    def fill_bitmasks(self, grammars: list, out, rows: list[int] | None = None) -> None:
        rows = list(range(len(grammars))) if rows is None else list(rows)
        if len(rows) != len(grammars):
            raise ValueError(f"fill_bitmasks: {len(grammars)} grammars for {len(rows)} rows")
        live: dict[int, tuple[object, list, list[int]]] = {}  # id(backend) -> (backend, grammars, rows)
        for g, r in zip(grammars, rows):
            if isinstance(g, FrozenGrammar):
                _put(out, r, g.rows[0])
            else:
                _, gs, rs = live.setdefault(id(g.backend), (g.backend, [], []))
                gs.append(g)
                rs.append(r)
        for be, gs, rs in live.values():
            be.fill_bitmasks(gs, out, rs)


FROZEN_BACKEND = FrozenBackend()


class FrozenGrammar:
    """One chunk's masks for one step. `rows[j]`: int32 [bitmask_width], the mask after `drafts[:j]`
    (rows[0] the next-token mask); equal rows of a step are one array (pickled once)."""

    __slots__ = ("drafts", "rows")
    backend = FROZEN_BACKEND

    def __init__(self, drafts: tuple[int, ...], rows: tuple[np.ndarray, ...]):
        if len(rows) != len(drafts) + 1:
            raise ValueError(f"FrozenGrammar: {len(rows)} rows for {len(drafts)} drafts (need drafts + 1)")
        self.drafts, self.rows = drafts, rows

    def __getstate__(self):
        return self.drafts, self.rows

    def __setstate__(self, state):
        self.drafts, self.rows = state

    def fill_bitmask(self, out) -> None:
        _put(out, None, self.rows[0])

    def fill_bitmasks_along(self, tokens: list[int], out) -> None:
        """out[j] = the mask after tokens[:j]; `tokens` must be the drafts frozen (ValueError otherwise)."""
        tokens = tuple(int(t) for t in tokens)
        if tokens != self.drafts:
            raise ValueError(f"fill_bitmasks_along: drafts {list(tokens)} asked, {list(self.drafts)} were frozen")
        if len(out) < len(tokens) + 1:
            raise ValueError(f"out has {len(out)} rows, need {len(tokens) + 1}")
        for j, row in enumerate(self.rows):
            _put(out, j, row)


def freeze_grammars(so: SchedulerOutput, vocab_size: int) -> SchedulerOutput:
    """A shallow copy of `so` whose sampled chunks with a grammar carry a FrozenGrammar (the masks the
    runner asks for in this step: the next-token mask, and for a chunk with num_draft k > 0 the k + 1
    masks along its last k token_ids); grammar chunks that sample nothing carry none; other chunks are
    shared. The live grammars' states are left as they were. `vocab_size`: the logits' width."""
    width = (vocab_size + 31) // 32
    if not any(c.grammar is not None for c in so.chunks):
        return so
    distinct: dict[bytes, np.ndarray] = {}  # one array per distinct mask in the step

    def keep(row: np.ndarray) -> np.ndarray:
        return distinct.setdefault(row.tobytes(), row)

    frozen: dict[tuple[int, tuple[int, ...]], FrozenGrammar] = {}  # (id(grammar), drafts) -> its frozen one
    nexts = {}  # id(grammar) -> grammar, of the chunks sampling without drafts
    for c in so.chunks:
        g = c.grammar
        if g is None or not c.num_samples or isinstance(g, FrozenGrammar):
            continue
        be_width = getattr(g.backend, "bitmask_width", width)
        if be_width != width:
            raise ValueError(f"freeze_grammars: vocab_size {vocab_size} gives {width} mask words, the grammar's "
                             f"backend fills {be_width}")
        drafts = tuple(int(t) for t in c.token_ids[len(c.token_ids) - c.num_draft:]) if c.num_draft else ()
        if drafts:
            if (id(g), drafts) not in frozen:
                buf = np.empty((len(drafts) + 1, width), dtype=np.int32)
                g.fill_bitmasks_along(list(drafts), buf)  # accepts the drafts, then rolls them back
                frozen[id(g), drafts] = FrozenGrammar(drafts, tuple(keep(r) for r in buf))
        else:
            nexts.setdefault(id(g), g)
    if nexts:  # as the runner fills them: one call per backend, on its threads
        by_backend: dict[int, list] = {}
        for g in nexts.values():
            by_backend.setdefault(id(g.backend), []).append(g)
        for gs in by_backend.values():
            buf = np.empty((len(gs), width), dtype=np.int32)
            gs[0].backend.fill_bitmasks(gs, buf)
            for g, r in zip(gs, buf):
                frozen[id(g), ()] = FrozenGrammar((), (keep(r),))
    chunks = []
    for c in so.chunks:
        g = c.grammar
        if g is None or isinstance(g, FrozenGrammar):
            chunks.append(c)
            continue
        c = copy.copy(c)
        if not c.num_samples:
            c.grammar = None  # nothing sampled: the runner reads no mask
        else:
            drafts = tuple(int(t) for t in c.token_ids[len(c.token_ids) - c.num_draft:]) if c.num_draft else ()
            c.grammar = frozen[id(g), drafts]
        chunks.append(c)
    out = copy.copy(so)
    out.chunks = chunks
    return out


def _put(out, r: int | None, row: np.ndarray) -> None:
    """out[r] = row (out[...] when r is None); out a numpy array or a CPU torch tensor."""
    key = Ellipsis if r is None else r
    if isinstance(out, np.ndarray):
        out[key] = row
    else:
        import torch
        out[key] = torch.from_numpy(row)

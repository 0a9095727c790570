"""CUDA graphs for decode and verify steps: q new tokens per request (q = 1: pure decode; q = 1 + the
drafts verified: a speculative step, which returns the logits of every row).

A graph is captured per (padded batch size, q, entry-width buckets): the batch is padded with
dummy requests that own the cache's scratch slot (q tokens at its positions 0 .. q-1), every token
gets a compressor row (FixedShape), and entry tables are rounded up to a power of two (at least
`visible_bucket`). With a drafter whose context is stored from the step's features (DSpark), that
store runs inside the graph (the padding requests' rows land in the scratch slot's rings).
The step is planned on the host; all its index tensors are packed into one pinned int64 buffer
and reach the captured inputs (views of one device buffer) in a single non-blocking copy, so a
step costs one copy and one graph launch. Pinned buffers rotate; one is refilled only after the
copy that last read it has run (its event), so planning step N+1 may overlap step N on the GPU.
A step whose tokens and starts only the device knows (a verify step scheduled ahead) is planned inside its
graph instead (`run_planned`, state/device_plan.py): the host packs slots and block tables, and the
device copies the tokens and starts into the captured inputs.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from deepinfer.state.decode_plan import decode_inputs
from deepinfer.state.device_plan import plan_on_device, table_width
from deepinfer.state.forward_batch import FixedShape, ForwardBatch, SeqChunk, build_forward_batch
from deepinfer.worker.kv_cache import V4Cache

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PINNED_BUFFERS = 3
VISIBLE_BUCKET = 64


_FIELDS: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    """A dataclass's field names, looked up once per class (planning runs every decode step)."""
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def _tensors(obj, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in a ForwardBatch, its plans included, in a fixed order."""
    out: list[tuple[str, torch.Tensor]] = []
    _walk(obj, prefix, out)
    return out


def _walk(obj, prefix: str, out: list) -> None:
    if isinstance(obj, torch.Tensor):
        out.append((prefix, obj))
    elif isinstance(obj, dict):
        for k in sorted(obj):
            _walk(obj[k], f"{prefix}[{k}]", out)
    elif obj is not None and (type(obj) in _FIELDS or dataclasses.is_dataclass(obj)):
        for name in _field_names(type(obj)):
            _walk(getattr(obj, name), f"{prefix}.{name}", out)


def _rebuild(obj, tensors):
    """`obj` with its tensors (in `_tensors` order) taken from the iterator `tensors`."""
    if isinstance(obj, torch.Tensor):
        return next(tensors)
    if dataclasses.is_dataclass(obj):
        return dataclasses.replace(obj, **{f.name: _rebuild(getattr(obj, f.name), tensors)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, dict):
        return {k: _rebuild(obj[k], tensors) for k in sorted(obj)}
    return obj


def visible_widths(max_position: int, ratios, bucket: int = VISIBLE_BUCKET) -> dict[int, int]:
    """Entry-table widths of a fixed-shape step: each ratio's entries visible at the furthest position, rounded up
    to a power of two (>= bucket): O(log context) graphs per batch size."""
    need = {m: (max_position + 1) // m for m in ratios}
    return {m: max(bucket, 1 << max(n - 1, 0).bit_length()) for m, n in need.items()}


def fixed_step_logits(model, cache: V4Cache, drafter, batch: ForwardBatch) -> torch.Tensor:
    """A fixed-shape step (what a graph captures): the logits of every row, and the drafter's context stored from
    the step's features (`drafter`: one with store_context, or None)."""
    if drafter is not None:
        states, features = model(batch, cache.layers, draft_features=True, token_history=cache.token_history)
        drafter.store_context(batch, features)
    else:
        states = model(batch, cache.layers, token_history=cache.token_history)
    # every row's logits: a fixed-shape step of one token a request has logits_idx = every row, in order
    return model.compute_logits(states)


class DecodeGraphs:
    def __init__(self, model, cache: V4Cache, scratch_slot: int, scratch_addr: dict[int, int],
                 visible_bucket: int = VISIBLE_BUCKET, batch_buckets: tuple[int, ...] = BATCH_BUCKETS,
                 device: str = "cuda",
                 drafter=None):
        """`drafter`: a proposer with `store_context(batch, features)` (worker/drafter.py DSparkDrafter), run in
        every captured step on the trunk's draft features; None: the trunk alone."""
        self.model, self.cache, self.device, self.drafter = model, cache, device, drafter
        self.scratch_slot, self.scratch_addr = scratch_slot, scratch_addr
        self.visible_bucket, self.batch_buckets = visible_bucket, batch_buckets
        # key -> (graph, device input buffer, logits)
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.pool = None
        self.pinned: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        self.turn = 0
        # (padded batch, q, visible widths) -> the graph key `_plan` made for them (the input layout)
        self.layouts: dict[tuple, tuple] = {}

    def plan(self, chunks: list[SeqChunk]) -> tuple[tuple, ForwardBatch]:
        """(graph key, fixed-shape batch) of a step of q tokens per request, padded with scratch requests."""
        return self._plan(chunks)[:2]

    def _plan(self, chunks: list[SeqChunk]) -> tuple[tuple, ForwardBatch, list[tuple[str, torch.Tensor]]]:
        """`plan`, and the batch's `_tensors` (walked once a step: the key and the staging read them)."""
        B, q = len(chunks), len(chunks[0].token_ids) if chunks else 1
        if any(len(c.token_ids) != q for c in chunks):
            raise ValueError(f"DecodeGraphs: every request of a step needs the same token count, got "
                             f"{sorted({len(c.token_ids) for c in chunks})}")
        padded = self._bucket(B)
        # a padding request holds positions 0 .. q-1 of the scratch slot: the entries they close (entry 0 with
        # ratio 1 .. ratio q) lie in the scratch block (the block whose first row is scratch_addr[m])
        bs = self.cache.block_size
        if q > bs:
            raise ValueError(f"DecodeGraphs: {q} tokens a request exceed the scratch block ({bs} entries)")
        dummy = SeqChunk(self.scratch_slot, 0, [0] * q, {m: [a // bs] for m, a in self.scratch_addr.items()})
        chunks = chunks + [dummy] * (padded - B)
        visible = self.visible(max(c.start for c in chunks) + q - 1)
        cfg = self.model.config
        batch = build_forward_batch(chunks, cfg.sliding_window, self.cache.compress_kinds, self.cache.block_size,
                                    "cpu", fixed=FixedShape(self.scratch_addr, visible),
                                    device_history=self.model.token_history, ring_slack=self.cache.ring_slack)
        named = _tensors(batch)
        key = self._key(padded, visible, named)
        self.layouts[padded, q, tuple(sorted(visible.items()))] = key
        return key, batch, named

    def visible_sets(self, max_position: int) -> list[tuple[int, dict[int, int]]]:
        """(the first position that has them, entry-table widths) of every width set of steps whose furthest
        position is at most `max_position`, shortest contexts first: `visible` changes only where one ratio's
        visible entry count passes a power of two (>= visible_bucket)."""
        points = {0, max_position}
        for m in self.scratch_addr:
            w = self.visible_bucket
            while m * (w + 1) - 1 <= max_position:  # the first position with w + 1 entries visible
                points.add(m * (w + 1) - 1)
                w *= 2
        first: dict[tuple, int] = {}
        for p in sorted(points):
            first.setdefault(tuple(sorted(self.visible(p).items())), p)
        return [(p, dict(v)) for v, p in first.items()]

    def capture_steps(self, max_batch: int, widths: list[int], max_position: int, limit: int,
                      planned: list[int] = ()) -> int:
        """Captures, before any request runs, the graph of every batch bucket up to `max_batch`, every q in
        `widths` (host-planned steps) and in `planned` (device-planned ones, run_planned) and every entry-table
        width set up to `max_position`, shortest contexts first, at most `limit` graphs (the rest are captured at
        their first step). Every request is the scratch slot, its tables the scratch block repeated: the steps
        write only scratch rows. -> the graphs captured."""
        bs, count = self.cache.block_size, 0
        scratch = {m: a // bs for m, a in self.scratch_addr.items()}
        buckets = [b for b in self.batch_buckets if b <= self._bucket(max_batch)]
        for _, visible in self.visible_sets(max_position):
            for q, padded in [(q, b) for q in planned if q <= bs for b in buckets]:
                key = ("planned", padded, q, tuple(sorted(visible.items())))
                if key in self.graphs:
                    continue
                if count >= limit:
                    return count
                zeros = torch.zeros(padded, dtype=torch.long, device=self.device)
                tables = {m: np.full((padded, table_width(visible[m], bs)), b, dtype=np.int64)
                          for m, b in scratch.items()}
                self.run_planned(zeros[:, None].expand(padded, q), zeros, [self.scratch_slot] * padded, tables, visible)
                count += 1
        for p, visible in self.visible_sets(max_position):
            for q in widths:
                start = max(0, p - q + 1)  # the step's furthest position: p, or q - 1 past it
                if q > bs or self.visible(start + q - 1) != visible:
                    continue
                tables = {m: [scratch[m]] * max(1, -(-((start + q) // m) // bs)) for m in scratch}
                chunk = SeqChunk(self.scratch_slot, start, [0] * q, tables)
                for padded in buckets:
                    if count >= limit:
                        return count
                    if self._plan([chunk] * padded)[0] not in self.graphs:
                        self.run([chunk] * padded)
                        count += 1
        return count

    def _bucket(self, num_requests: int) -> int:
        return next(b for b in self.batch_buckets if b >= num_requests)

    def visible(self, max_position: int) -> dict[int, int]:
        return visible_widths(max_position, self.scratch_addr, self.visible_bucket)

    @torch.inference_mode()
    def run_rows(self, rows, fill: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """`run` for a step given as engine/outputs.py DecodeRows: planned from the arrays (state/decode_plan.py)
        into the pinned buffer once a graph of its layout exists; the first step of a layout goes through
        `run` (build_forward_batch, capture)."""
        B = len(rows.slots)
        padded = self._bucket(B)
        # padding rows (see _plan): position 0 of the scratch slot, token 0, the scratch block as table
        visible = self.visible(int(rows.positions.max()) if B else 0)
        key = self.layouts.get((padded, 1, tuple(sorted(visible.items()))))
        entry = None if key is None else self.graphs.get(key)
        if entry is None:
            return self.run([SeqChunk(int(s), int(p), [int(t)], {m: rows.tables[m][b, :rows.table_len[m][b]].tolist()
                                                                 for m in rows.tables})
                             for b, (s, p, t) in enumerate(zip(rows.slots, rows.positions, rows.tokens))], fill)
        pad, bs = padded - B, self.cache.block_size
        tables, lens = {}, {}
        for m, a in self.scratch_addr.items():
            t = rows.tables[m]
            tables[m] = np.concatenate((t, np.zeros((pad, t.shape[1]), dtype=np.int64)))
            if pad:
                tables[m][B:, 0] = a // bs
            lens[m] = np.concatenate((rows.table_len[m], np.ones(pad, dtype=np.int64)))
        cfg = self.model.config
        arrays = decode_inputs(np.concatenate((rows.tokens, np.zeros(pad, dtype=np.int64))),
                               np.concatenate((rows.slots, np.full(pad, self.scratch_slot, dtype=np.int64))),
                               np.concatenate((rows.positions, np.zeros(pad, dtype=np.int64))), tables, lens,
                               cfg.sliding_window, self.cache.compress_kinds, self.cache.block_size,
                               FixedShape(self.scratch_addr, visible), self.model.token_history, self.cache.ring_slack)
        buf = self._buffer(entry[1].numel())
        np.concatenate([a.reshape(-1) for a in arrays], out=buf.numpy())
        return self._replay(entry, buf, fill, B)

    @staticmethod
    def _key(padded: int, visible: dict[int, int], named: list[tuple[str, torch.Tensor]]) -> tuple:
        # the input layout (which tensors, their shapes) is part of the key: a graph reads exactly those
        return padded, tuple(sorted(visible.items())), tuple((name, tuple(t.shape)) for name, t in named)

    def _stage(self, batch: ForwardBatch, named: list[tuple[str, torch.Tensor]] | None = None) -> torch.Tensor:
        """The batch's index tensors (`named`: `_tensors(batch)`, when the caller has it) packed into the
        next free pinned buffer (a flat int64 view)."""
        parts = [t.reshape(-1) for _, t in (named if named is not None else _tensors(batch))]
        if any(p.dtype != torch.long for p in parts):
            raise TypeError("decode graph inputs must all be int64 index tensors")
        buf = self._buffer(sum(p.numel() for p in parts))
        torch.cat(parts, out=buf)
        return buf

    def _buffer(self, n: int) -> torch.Tensor:
        """The next pinned buffer's first n int64 (its previous upload done)."""
        pin = torch.device(self.device).type == "cuda"
        if len(self.pinned) < PINNED_BUFFERS:
            self.pinned.append((torch.empty(0, dtype=torch.long, pin_memory=pin), None))
        buf, done = self.pinned[self.turn]
        if done is not None:
            done.synchronize()  # the copy that last read this buffer has run
        if buf.numel() < n:
            buf = torch.empty(max(n, 2 * buf.numel()), dtype=torch.long, pin_memory=pin)
        return buf[:n]

    def _upload(self, staged: torch.Tensor, dst: torch.Tensor) -> None:
        dst.copy_(staged, non_blocking=True)
        event = None
        if dst.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self.pinned[self.turn] = (staged._base if staged._base is not None else staged, event)
        self.turn = (self.turn + 1) % PINNED_BUFFERS

    def fits(self, num_requests: int) -> bool:
        return num_requests <= self.batch_buckets[-1]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The step eagerly (what a graph captures): logits of every (padded) token, and the drafter's context
        stored. A host-planned batch is moved to the device first."""
        if batch.input_ids.device.type != torch.device(self.device).type:
            batch = _rebuild(batch, iter([t.to(self.device) for _, t in _tensors(batch)]))
        return fixed_step_logits(self.model, self.cache, self.drafter, batch)

    @torch.inference_mode()
    def run(self, chunks: list[SeqChunk], fill: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Logits [len(chunks) * q, V] of a step of q tokens per chunk (chunk b's at rows b*q ..). `fill` = (rows,
        device token ids) overwrites those flat rows' input ids after the upload (placeholder inputs)."""
        key, batch, named = self._plan(chunks)
        rows = sum(len(c.token_ids) for c in chunks)
        staged = self._stage(batch, named)
        entry = self.graphs.get(key)
        if entry is None:
            inputs = torch.empty(staged.numel(), dtype=torch.long, device=self.device)
            self._upload(staged, inputs)
            if fill is not None:  # input_ids lead the packed buffer
                inputs[fill[0]] = fill[1]
            entry = self._capture(batch, inputs)
            self.graphs[key] = entry
            self._launch_graph(entry)
            return entry[2][:rows]
        return self._replay(entry, staged, fill, rows)

    @torch.inference_mode()
    def run_planned(self, tokens: torch.Tensor, starts: torch.Tensor, slots: list[int],
                    tables: dict[int, np.ndarray], visible: dict[int, int]) -> torch.Tensor:
        """Logits [B * q, V] of a step of q tokens per request whose tokens [B, q] and starts [B] are device
        tensors (a step launched before the host knows them): the graph plans the step itself
        (state/device_plan.py). `tables[m]` [B, table_width(visible[m])] block ids, scratch past each table."""
        B, q = tokens.shape
        padded = self._bucket(B)
        key, staged = self.stage_planned(B, q, slots, tables, visible)
        n = staged.numel()
        entry = self.graphs.get(key)
        if entry is None:
            inputs = torch.empty(n, dtype=torch.long, device=self.device)
            self._upload(staged, inputs)
            self._fill_planned(inputs, tokens, starts, padded)
            entry = self.graphs[key] = self._capture_with(lambda: self._planned_batch(inputs, padded, q, visible),
                                                          inputs)
        else:
            self._upload(staged, entry[1])
            self._fill_planned(entry[1], tokens, starts, padded)
        self._launch_graph(entry)
        return entry[2][:B * q]

    def stage_planned(self, B: int, q: int, slots: list[int], tables: dict[int, np.ndarray],
                      visible: dict[int, int]) -> tuple[tuple, torch.Tensor]:
        """(graph key, the next pinned buffer holding the step's host inputs: zeros where the device's tokens and
        starts go, the slots and tables, padding rows on the scratch slot and block)."""
        padded = self._bucket(B)
        bs, ms = self.cache.block_size, sorted(self.scratch_addr)
        if q > bs:
            raise ValueError(f"DecodeGraphs: {q} tokens a request exceed the scratch block ({bs} entries)")
        widths = [table_width(visible[m], bs) for m in ms]
        staged = self._buffer(padded * (q + 2) + padded * sum(widths))
        host = staged.numpy()
        host[:padded * (q + 1)] = 0  # tokens and starts: the device's, padding rows token 0 at position 0
        host[padded * (q + 1):padded * (q + 2)] = list(slots) + [self.scratch_slot] * (padded - B)
        off = padded * (q + 2)
        for m, w in zip(ms, widths):
            t = host[off:off + padded * w].reshape(padded, w)
            t[:B] = tables[m]
            t[B:] = self.scratch_addr[m] // bs
            off += padded * w
        return ("planned", padded, q, tuple(sorted(visible.items()))), staged

    @staticmethod
    def _fill_planned(inputs: torch.Tensor, tokens: torch.Tensor, starts: torch.Tensor, padded: int) -> None:
        B, q = tokens.shape
        inputs[:B * q].copy_(tokens.reshape(-1))
        inputs[padded * q:padded * q + B].copy_(starts)

    def _planned_batch(self, inputs: torch.Tensor, padded: int, q: int, visible: dict[int, int]) -> ForwardBatch:
        """The step planned on the device from the packed inputs' views (run_planned's layout)."""
        bs, ms = self.cache.block_size, sorted(self.scratch_addr)
        tokens, starts, slots = inputs[:padded * q], inputs[padded * q:padded * (q + 1)], \
            inputs[padded * (q + 1):padded * (q + 2)]
        off, tables = padded * (q + 2), {}
        for m in ms:
            w = table_width(visible[m], bs)
            tables[m] = inputs[off:off + padded * w].view(padded, w)
            off += padded * w
        cfg = self.model.config
        return plan_on_device(tokens, starts, slots, tables, q, cfg.sliding_window, self.cache.compress_kinds, bs,
                              FixedShape(self.scratch_addr, visible), self.model.token_history, self.cache.ring_slack)

    def _replay(self, entry, staged: torch.Tensor, fill, rows: int) -> torch.Tensor:
        inputs = entry[1]
        self._upload(staged, inputs)
        if fill is not None:  # input_ids lead the packed buffer
            inputs[fill[0]] = fill[1]
        self._launch_graph(entry)
        return entry[2][:rows]

    def _launch_graph(self, entry) -> None:
        entry[0].replay()

    @staticmethod
    def input_views(host_batch: ForwardBatch, inputs: torch.Tensor) -> ForwardBatch:
        """The batch rebuilt as views of the packed input buffer (what a captured graph reads)."""
        views, off = [], 0
        for _, t in _tensors(host_batch):
            views.append(inputs[off:off + t.numel()].view(t.shape))
            off += t.numel()
        return _rebuild(host_batch, iter(views))

    def _capture(self, host_batch: ForwardBatch, inputs: torch.Tensor):
        """The batch rebuilt as views of `inputs` (what the graph reads), captured (_capture_with)."""
        batch = self.input_views(host_batch, inputs)
        return self._capture_with(lambda: batch, inputs)

    def _capture_with(self, make_batch, inputs: torch.Tensor):
        """Warm up on a side stream (the cache rows written belong to this very step, so the repeated writes are
        idempotent), then capture the launches of forward(make_batch()): the planning too, where make_batch
        plans on the device."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.forward(make_batch())
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.forward(make_batch())
        return graph, inputs, out

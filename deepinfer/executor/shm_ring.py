"""The driver's step messages to this node's other ranks through a shared-memory ring (one writer, n readers).

A gloo broadcast of a pickled message costs two collectives (size, bytes) plus tensor conversions on
every rank, every step: ~0.2 ms at world size 1 on a 2-core CPU, more with ranks. The ring costs the
writer one pickle and one copy, and a reader one copy, with no collective.

Layout: `SLOTS` slots, each [seq int64][length int64][one read flag per reader, padded][slot_bytes data].
Invariants:
- message m (1, 2, ...) is written to slot m % SLOTS; the writer overwrites a slot only after every reader
  has set its read flag for the message there (a slot never written has seq 0);
- the writer publishes a message by storing its seq last (after data, length, and the flags reset); a
  reader reads the slot only once seq == m, and sets its flag only after copying the data out;
- a message longer than slot_bytes is published as length -1 and its bytes go by the gloo broadcast
  (parallel_state.broadcast_object), which every reader then joins in message order.
Publishing and observing are separated by a lock acquire / release (the barrier CPython offers; x86, where
the engine's GPUs are hosted, keeps stores in program order regardless).

Waiting: a reader yields the CPU between polls for `spin_s` (low latency while steps run back to back), then
sleeps SLEEP_S per poll, IDLE_SLEEP_S after IDLE_S (an idle server's ranks cost next to nothing); it raises if
its parent (the driver, on this node) is gone. The writer waits for a slot the same way, calling `check()` (the
driver's watch of its ranks: raises if one died) and raising TimeoutError after `timeout_s`.

The ring lives in a file under /dev/shm (the temporary directory where there is none), mapped by every
rank of the node; the driver removes it when the engine closes.
"""
from __future__ import annotations

import mmap
import os
import pickle
import struct
import tempfile
import threading
import time
import uuid
from typing import Callable

from deepinfer.distributed import parallel_state as ps

SLOTS = 4
SLOT_BYTES = 1 << 20
SLEEP_S = 1e-4
IDLE_S, IDLE_SLEEP_S = 1.0, 1e-3  # waiting longer than IDLE_S (an idle server): poll every IDLE_SLEEP_S
_FENCE = threading.Lock()
_HEAD = struct.Struct("<qq")  # seq, length


def _fence() -> None:
    with _FENCE:
        pass


def _flag_bytes(readers: int) -> int:
    return (readers + 7) // 8 * 8


def _slot_stride(readers: int, slot_bytes: int) -> int:
    return _HEAD.size + _flag_bytes(readers) + slot_bytes


def _wait(ready: Callable[[], bool], spin_s: float, timeout_s: float, check: Callable[[], None], what: str) -> None:
    """Poll `ready()`: yield for `spin_s`, then sleep SLEEP_S per poll; `check()` between sleeps."""
    if ready():
        return
    start = time.monotonic()
    while not ready():
        waited = time.monotonic() - start
        if waited < spin_s:
            os.sched_yield()
            continue
        check()
        if waited > timeout_s:
            raise TimeoutError(f"{what} for {waited:.0f} s (timeout_s={timeout_s:.0f})")
        time.sleep(SLEEP_S if waited < IDLE_S else IDLE_SLEEP_S)


class ShmRing:
    """The ring of one node. The driver makes it (`ShmRing.create`, then `send`); each other rank of the
    node attaches (`ShmRing.attach` with its reader index, then `recv`)."""

    def __init__(self, path: str, readers: int, reader: int | None, spin_s: float, timeout_s: float,
                 slot_bytes: int):
        self.path, self.readers, self.reader = path, readers, reader
        self.spin_s, self.timeout_s, self.slot_bytes = spin_s, timeout_s, slot_bytes
        self.stride = _slot_stride(readers, slot_bytes)
        self._data = _HEAD.size + _flag_bytes(readers)  # the data's offset in a slot
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), self.stride * SLOTS)
        self._buf = memoryview(self._map)
        self._seq = 0  # the last message written (driver) or read (reader)
        self._parent = os.getppid()

    @classmethod
    def create(cls, readers: int, spin_s: float, timeout_s: float, slot_bytes: int = SLOT_BYTES) -> "ShmRing":
        root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        path = os.path.join(root, f"deepinfer-ring-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        with open(path, "wb") as f:
            f.truncate(_slot_stride(readers, slot_bytes) * SLOTS)  # zeros: every slot's seq is 0 (never written)
        return cls(path, readers, None, spin_s, timeout_s, slot_bytes)

    @classmethod
    def attach(cls, path: str, readers: int, reader: int, spin_s: float, timeout_s: float,
               slot_bytes: int = SLOT_BYTES) -> "ShmRing":
        """`readers` and `slot_bytes` as the driver created the ring with."""
        if not 0 <= reader < readers:
            raise ValueError(f"reader: expected 0 <= reader < {readers}, got {reader}")
        return cls(path, readers, reader, spin_s, timeout_s, slot_bytes)

    # slot fields
    def _base(self, m: int) -> int:
        return (m % SLOTS) * self.stride

    def _head(self, m: int) -> tuple[int, int]:
        return _HEAD.unpack_from(self._buf, self._base(m))

    def _flags(self, m: int) -> memoryview:
        b = self._base(m) + _HEAD.size
        return self._buf[b:b + self.readers]

    # the driver
    def send(self, obj, check: Callable[[], None] = lambda: None) -> None:
        """`obj` to every reader (pickled); waits while the slot's previous message is unread."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        m = self._seq + 1
        flags = self._flags(m)

        def free() -> bool:
            return self._head(m)[0] == 0 or all(flags)
        _wait(free, self.spin_s, self.timeout_s, check, f"a rank of this node has not read message {m - SLOTS}")
        _fence()
        base, big = self._base(m), len(data) > self.slot_bytes
        if not big:
            self._buf[base + self._data:base + self._data + len(data)] = data
        flags[:] = bytes(self.readers)
        _HEAD.pack_into(self._buf, base, 0, -1 if big else len(data))
        _fence()
        struct.pack_into("<q", self._buf, base, m)  # published
        self._seq = m
        if big:
            ps.broadcast_object(data)

    # a reader
    def recv(self):
        """The next message (blocks until the driver sends it)."""
        m = self._seq + 1
        _wait(lambda: self._head(m)[0] == m, self.spin_s, float("inf"), self._check_parent, "waiting for the driver")
        _fence()
        _, length = self._head(m)
        if length >= 0:
            start = self._base(m) + self._data
            data = bytes(self._buf[start:start + length])
        _fence()
        self._flags(m)[self.reader] = 1
        self._seq = m
        if length < 0:
            data = ps.broadcast_object(None)
        return pickle.loads(data)

    def _check_parent(self) -> None:
        if os.getppid() != self._parent:
            raise RuntimeError("the driver process is gone (this rank's parent exited)")

    def close(self) -> None:
        """Unmap; the driver also removes the file."""
        self._buf.release()
        self._map.close()
        if self.reader is None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

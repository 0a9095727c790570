"""The driver's shared-memory ring (executor/shm_ring.py): order, wrap-around, the gloo path of long messages,
and the ways a wait ends (a dead reader, a timeout, a vanished driver)."""
from __future__ import annotations

import os
import time

import pytest
import torch.multiprocessing as mp

from deepinfer.distributed import parallel_state as ps
from deepinfer.executor.shm_ring import SLOTS, ShmRing

SLOT_BYTES = 256  # small: the long messages below take the gloo path


def messages() -> list:
    # short and long (> SLOT_BYTES pickled) interleaved, six times round the ring
    return [("step", i, "x" * (1000 if i % 5 == 0 else 3)) for i in range(6 * SLOTS)]


def _join(rank: int, init: str) -> None:
    ps.init_parallel(ps.ParallelConfig(tensor_parallel_size=2), rank, "cpu", init, 60.0)


def _reader(path: str, init: str, out) -> None:
    _join(1, init)
    ring = ShmRing.attach(path, 1, 0, spin_s=0.0, timeout_s=60, slot_bytes=SLOT_BYTES)
    got = []
    while (msg := ring.recv()) is not None:
        got.append(msg)
        if len(got) % 7 == 0:
            time.sleep(0.05)  # a slow reader: the writer waits for its slots
    ring.close()
    out.put(got)
    ps.destroy()


def test_a_reader_gets_every_message_in_order_short_and_long(tmp_path):
    ring = ShmRing.create(1, spin_s=0.0, timeout_s=60, slot_bytes=SLOT_BYTES)
    init = f"file://{tmp_path / 'store'}"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_reader, args=(ring.path, init, out))
    p.start()
    try:
        _join(0, init)
        for msg in messages():
            ring.send(msg)
        ring.send(None)
        assert out.get(timeout=60) == messages()
    finally:
        p.join(timeout=30)
        ps.destroy()
        ring.close()
    assert p.exitcode == 0
    assert not os.path.exists(ring.path)  # the driver removes the ring's file


def test_the_writer_waits_for_an_unread_slot_then_raises_what_check_raises_or_times_out():
    ring = ShmRing.create(1, spin_s=0.0, timeout_s=0.3)
    try:
        for i in range(SLOTS):  # every slot free once
            ring.send(i)

        def dead():
            raise RuntimeError("rank 1 exited")
        with pytest.raises(RuntimeError, match="rank 1 exited"):
            ring.send("one too many", check=dead)
        t = time.monotonic()
        with pytest.raises(TimeoutError, match="has not read message 1"):
            ring.send("one too many")
        assert time.monotonic() - t < 5.0
        reader = ShmRing.attach(ring.path, 1, 0, spin_s=0.0, timeout_s=1.0)
        assert reader.recv() == 0  # read: its slot is free again
        ring.send("now fits")
        assert [reader.recv() for _ in range(SLOTS)] == list(range(1, SLOTS)) + ["now fits"]
        reader.close()
    finally:
        ring.close()


def test_a_waiting_reader_raises_when_its_driver_is_gone(monkeypatch):
    ring = ShmRing.create(1, spin_s=0.0, timeout_s=1.0)
    reader = ShmRing.attach(ring.path, 1, 0, spin_s=0.0, timeout_s=1.0)
    try:
        monkeypatch.setattr(os, "getppid", lambda: -1)  # the parent changed: the driver exited
        with pytest.raises(RuntimeError, match="driver process is gone"):
            reader.recv()
    finally:
        reader.close()
        ring.close()


def test_a_ring_without_readers_takes_every_message():
    """The multi-process executor at one rank: nobody reads, nothing waits."""
    ring = ShmRing.create(0, spin_s=0.0, timeout_s=0.1)
    try:
        for i in range(3 * SLOTS):
            ring.send(("launch", i))
    finally:
        ring.close()


def test_attach_refuses_a_reader_index_out_of_range():
    ring = ShmRing.create(1, spin_s=0.0, timeout_s=0.1)
    try:
        with pytest.raises(ValueError, match="reader: expected 0 <= reader < 1, got 1"):
            ShmRing.attach(ring.path, 1, 1, spin_s=0.0, timeout_s=0.1)
    finally:
        ring.close()


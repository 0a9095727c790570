"""A multi-process LLM gives back its ranks, its process group and this process's rank 0 however it ends:
close(), a `with` block (also one left by an exception), its last reference dropped, the collector, or
the interpreter exiting with it open (tiny model, 2 gloo ranks on the CPU)."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.distributed import parallel_state
from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0, max_tokens=3)
ENGINE = dict(device="cpu", dtype="float32", kv_cache_dtype="float32", kv_cache_memory=16 << 20,
              max_num_batched_tokens=16, skip_tokenizer_init=True)
# exits with its LLM open; prints the tokens and when it got to its end
NO_CLOSE = """import sys, time
from deepinfer import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM(sys.argv[1], tensor_parallel_size=2, device="cpu", dtype="float32", kv_cache_dtype="float32",
              kv_cache_memory=16 << 20, max_num_batched_tokens=16, skip_tokenizer_init=True)
    out = llm.generate([[0, 5, 17]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    print(len(out[0].outputs[0].token_ids), time.time(), flush=True)
"""


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("lifecycle") / "ckpt", PRESETS["tiny"], seed=5, dtype="fp8")


def _tokens(llm: LLM) -> list[int]:
    return llm.generate([[0, 5, 17, 33, 99]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def _released(procs) -> bool:
    return parallel_state.rank_info() is None and not any(p.is_alive() for p in procs)


def test_a_parallel_llm_dropped_without_close_releases_its_ranks(ckpt):
    llm = LLM(str(ckpt), tensor_parallel_size=2, **ENGINE)
    want = _tokens(llm)
    procs, ref = list(llm.engine.executor._procs.values()), weakref.ref(llm)
    del llm  # the last reference: freed at once, no collection needed
    assert ref() is None and _released(procs)
    llm = LLM(str(ckpt), tensor_parallel_size=2, **ENGINE)
    assert _tokens(llm) == want
    procs, cycle = list(llm.engine.executor._procs.values()), [llm]
    cycle.append(cycle)
    del llm, cycle  # kept by garbage in a reference cycle: freed by the collector
    gc.collect()
    assert _released(procs)


def test_a_with_block_closes_a_parallel_llm_also_when_left_by_an_exception(ckpt):
    with pytest.raises(KeyError, match="left"):
        with LLM(str(ckpt), data_parallel_size=2, **ENGINE) as llm:
            assert len(_tokens(llm)) == GREEDY.max_tokens
            procs = list(llm.engine.executor._procs.values())
            # one open engine's rank 0 per process: refused before any rank is spawned, saying what to do
            with pytest.raises(RuntimeError, match=r"LLM\.close\(\), or build it as `with LLM\(\.\.\.\) as llm:`"):
                LLM(str(ckpt), tensor_parallel_size=2, **ENGINE)
            raise KeyError("left by an exception")
    assert _released(procs)
    llm.close()  # closing again does nothing
    with pytest.raises(RuntimeError, match="LLM is closed"):
        _tokens(llm)


def test_a_script_that_never_closes_its_parallel_llm_exits_cleanly(ckpt, tmp_path):
    """At interpreter exit the ranks are told to stop and the group's rendezvous files are removed."""
    script, tmp = tmp_path / "no_close.py", tmp_path / "tmp"
    script.write_text(NO_CLOSE)
    tmp.mkdir()
    res = subprocess.run([sys.executable, str(script), str(ckpt)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp)})
    assert res.returncode == 0, res.stderr[-3000:]
    count, at_end = res.stdout.split()
    assert count == "2" and time.time() - float(at_end) < 30
    assert not any(w in res.stderr for w in ("Traceback", "Error", "Exception")), res.stderr[-3000:]
    assert not list(tmp.glob("deepinfer-pg-*"))

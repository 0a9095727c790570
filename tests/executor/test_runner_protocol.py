"""Every runner EngineCore drives meets the declared Runner protocol (engine/runner.py), so the engine core reads no
member it has to probe for."""
from __future__ import annotations

import pytest

from deepinfer.distributed.context_parallel import CPRunner
from deepinfer.engine.runner import Runner
from deepinfer.executor.engine import _LockstepReplica
from deepinfer.executor.multiproc import ReplicaRunner
from deepinfer.worker.model_runner import ModelRunner


def _members(protocol) -> set[str]:
    return {n for cls in protocol.__mro__ if cls not in (object,) and cls.__module__ == Runner.__module__
            for n in vars(cls) if not n.startswith("_")}


def test_the_protocols_declare_the_engine_cores_calls():
    assert _members(Runner) == {"supports_placeholders", "execute", "launch", "collect", "complete"}


@pytest.mark.parametrize("cls", [ModelRunner, CPRunner, ReplicaRunner, _LockstepReplica])
def test_every_runner_meets_the_protocol(cls):
    missing = sorted(m for m in _members(Runner) if not hasattr(cls, m) and m not in _instance_attrs(cls))
    assert not missing, f"{cls.__name__} lacks {missing}"


def _instance_attrs(cls) -> set[str]:
    """Members set in __init__ (ReplicaRunner copies supports_placeholders from its rank's runner)."""
    import inspect
    import re

    return set(re.findall(r"self\.(\w+)\s*=", inspect.getsource(cls.__init__)))

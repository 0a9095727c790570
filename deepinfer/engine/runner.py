"""Runner: what EngineCore drives, whatever runs the model (worker/model_runner.py ModelRunner in this
process, the multi-process executor's replica, a lockstep data-parallel replica's gathered output)."""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from deepinfer.engine.outputs import ModelOutput, SchedulerOutput


@runtime_checkable
class Runner(Protocol):
    @property
    def supports_placeholders(self) -> bool:
        """Steps may be launched ahead: a decode input may be PLACEHOLDER, the token its request samples in
        the step launched before (async scheduling). False: each step is collected before the next launches."""

    def launch(self, so: SchedulerOutput, prev: Any = None) -> Any:
        """Enqueue the step (its placeholders read `prev`'s tokens) -> a handle; may return before it runs."""

    def collect(self, handle: Any) -> ModelOutput:
        """Wait for a launched step's output (the one host sync of a step)."""

    def complete(self, handle: Any) -> None:
        """Sample a step launched ahead whose grammar masks needed the step before it (a no-op otherwise)."""

    def execute(self, so: SchedulerOutput) -> ModelOutput:
        """Run one step and wait for its output (collect(launch(so)); start-up profiling calls it)."""

"""The in-process executor: one Worker in this process (world size 1, no process group)."""
from __future__ import annotations

from deepinfer.executor.worker import EngineArgs, Worker


class InProcExecutor:
    kind = "one-process"
    failure = None  # a failing step raises from the runner and aborts only its requests (EngineCore)

    def __init__(self, args: EngineArgs):
        if args.parallel.world_size != 1:
            raise ValueError(f"parallel: the in-process executor runs one rank, not {args.parallel.world_size}")
        self.args = args
        self.worker = Worker(args)

    def replica_runner(self):
        return self.worker.runner

    def check_open(self) -> None:
        pass

    def close(self) -> None:
        pass

"""EngineCore.step(): schedule -> execute -> update (+ detokenise, stop strings).

With async scheduling (the default where the runner supports it) a step launches its GPU work,
then plans and launches the next one (Scheduler.schedule_ahead, placeholder inputs) before
waiting for its own sampled tokens, so the host work of step N+1 overlaps step N on the GPU.
"""
from __future__ import annotations

from deepinfer.engine.detokenizer import DecodeState, Detokenizer
from deepinfer.engine.outputs import CompletionOutput
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import Scheduler


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner, detokenizer: Detokenizer | None,
                 async_scheduling: bool = False):
        self.scheduler, self.runner, self.detok = scheduler, runner, detokenizer
        self.decode_state: dict[str, DecodeState] = {}
        self.async_scheduling = async_scheduling and getattr(runner, "supports_placeholders", False)
        self.inflight = None  # (SchedulerOutput, StepHandle) launched ahead, not yet updated

    def add_request(self, req: Request) -> None:
        """Queue `req`; its n > 1 siblings (req.siblings) start when its prompt is prefilled."""
        for r in [req] + req.siblings:
            self.decode_state[r.request_id] = DecodeState()
        self.scheduler.add(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Request]:
        """One model step; returns the requests that finished in it."""
        if self.inflight is not None:
            so, handle = self.inflight
        else:
            so = self.scheduler.schedule()
            if not so.chunks:
                raise RuntimeError("scheduler made no progress: the cache cannot hold any waiting request")
            handle = self.runner.launch(so) if self.async_scheduling else None
        self.inflight = None
        if handle is None:
            mo = self.runner.execute(so)
        else:
            ahead = self.scheduler.schedule_ahead(so)
            if ahead is not None:
                self.inflight = (ahead, self.runner.launch(ahead, handle))
            mo = self.runner.collect(handle)
        finished = []
        for req in self.scheduler.update(so, mo):
            if self.detok is not None and req.params.stop and not req.finished:
                st = self.decode_state[req.request_id]
                self.detok.update(st, req.output_token_ids, req.params.stop)
                if st.stop_hit:
                    self.scheduler.finish(req, "stop")
            if req.finished:
                finished.append(req)
        if self.inflight is not None and not self.scheduler.has_unfinished():
            self.runner.collect(self.inflight[1])  # every request finished by a stop token: drop it
            self.inflight = None
        return finished

    def completion(self, req: Request, index: int) -> CompletionOutput:
        st = self.decode_state.pop(req.request_id)
        text = self.detok.finalize(st, req.output_token_ids) if self.detok is not None else ""
        return CompletionOutput(index, text, list(req.output_token_ids), req.finish_reason,
                                list(req.logprobs) if req.params.logprobs is not None else None)

"""EngineCore.step(): schedule -> execute -> update (+ detokenise, stop strings).

With async scheduling (the default where the runner supports it) a step launches its GPU work,
then plans and launches the next one (Scheduler.schedule_ahead, placeholder inputs) before
waiting for its own sampled tokens, so the host work of step N+1 overlaps step N on the GPU.

A step that raises (model, sampler, runner, or the scheduler's update of its output) aborts the
requests it was computing, and those of a step launched ahead of it: they finish with reason
"abort" and the error, their slot, blocks and detokenizer state are released, and the step
launched ahead is discarded. Every other request carries on. A request whose stop-string check
raises is aborted alone.
"""
from __future__ import annotations

import dataclasses
import logging
import time

from deepinfer.engine.detokenizer import DecodeState, Detokenizer
from deepinfer.engine.outputs import CompletionOutput, SchedulerOutput
from deepinfer.engine.request import Request
from deepinfer.engine.runner import Runner
from deepinfer.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)

GRAMMAR_POLL_S = 0.0005  # how often an engine with nothing else to run checks on compiling grammars


@dataclasses.dataclass
class StartedStep:
    """A step between EngineCore.start_step and finish_step."""

    failed: list[Request]  # requests aborted before the step (failed grammars)
    so: SchedulerOutput
    handle: object = None  # the launched step (None: launching it failed)
    ahead: SchedulerOutput | None = None  # the next step, launched ahead
    ahead_error: Exception | None = None  # launching it failed (this step still completes)
    error: Exception | None = None  # launching this step failed


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: Runner, detokenizer: Detokenizer | None,
                 async_scheduling: bool = False):
        self.scheduler, self.runner, self.detok = scheduler, runner, detokenizer
        self.decode_state: dict[str, DecodeState] = {}
        self.requests: dict[str, Request] = {}  # every request added and not yet finished
        self.async_scheduling = async_scheduling and runner.supports_placeholders
        self.inflight = None  # (SchedulerOutput, StepHandle) launched ahead, not yet updated

    def add_request(self, req: Request) -> None:
        """Queue `req`; its n > 1 siblings (req.siblings) start when its prompt is prefilled."""
        for r in [req] + req.siblings:
            self.decode_state[r.request_id] = DecodeState()
            self.requests[r.request_id] = r
        self.scheduler.add(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Request]:
        """One model step; returns the requests that finished in it (aborted ones included)."""
        return self.finish_step(self.start_step())

    def start_step(self, wait_grammars: bool = True) -> "StartedStep | list[Request]":
        """The launch half of a step: schedule (or take the step launched ahead), launch it, plan and launch
        the next one ahead. -> what finish_step needs, or the finished requests of a step with nothing to
        run (without `wait_grammars`, also while the only requests that could run wait for their grammars).
        Data-parallel replicas in lockstep start every replica's step before finishing any."""
        failed = self.grammar_failures()
        if self.inflight is not None:
            (so, handle), self.inflight = self.inflight, None
        else:
            if not self.scheduler.has_unfinished():
                return failed
            so, handle = self._schedule(wait_grammars), None
            if not so.chunks:
                failed += self.grammar_failures()  # a compile that failed since the check above
                if failed or not wait_grammars and self.compiling():
                    return failed
                raise RuntimeError("scheduler made no progress: the cache cannot hold any waiting request")
        st = StartedStep(failed, so, handle)
        try:
            if st.handle is None:
                st.handle = self.runner.launch(so)
            if self.async_scheduling:
                st.ahead = self.scheduler.schedule_ahead(so)
                if st.ahead is not None:
                    try:
                        self.inflight = (st.ahead, self.runner.launch(st.ahead, st.handle))
                    except Exception as e:  # the look-ahead step failed; this one still completes
                        st.ahead_error = e
        except Exception as e:
            st.error = e
        return st

    def finish_step(self, st: "StartedStep | list[Request]") -> list[Request]:
        """The collect half: wait for the step's output, update the scheduler, check stops."""
        if isinstance(st, list):
            return st
        so, ahead = st.so, st.ahead
        try:
            if st.error is not None:
                raise st.error
            mo = self.runner.collect(st.handle)
            touched = self.scheduler.update(so, mo)
            if self.inflight is not None:  # a step launched ahead whose grammar masks needed this step's tokens
                self.runner.complete(self.inflight[1])
        except Exception as e:
            return st.failed + self._fail_step(so, ahead, e)
        finished = st.failed + [req for req in touched if self._check_stop(req)]
        if self.inflight is not None and not self.scheduler.has_unfinished():
            self._drop_inflight()  # every request finished by a stop token
        for req in finished:
            self.requests.pop(req.request_id, None)
        if st.ahead_error is not None:
            finished += self._fail_step(ahead, None, st.ahead_error)
        return finished

    def _schedule(self, wait_grammars: bool = True) -> SchedulerOutput:
        """The next step; while the only requests that could run wait for their grammars to compile
        (structured outputs, compiled on worker threads), waits for one of them (or, without
        `wait_grammars`, returns the empty step)."""
        while True:
            so = self.scheduler.schedule()
            grammars = [r.grammar for r in self.scheduler.waiting_grammars]
            if so.chunks or all(g.ready() for g in grammars) or any(g.ready() and g.error for g in grammars) \
                    or not wait_grammars:
                return so
            time.sleep(GRAMMAR_POLL_S)

    def compiling(self) -> bool:
        """A waiting request's grammar is still compiling."""
        return any(not r.grammar.ready() for r in self.scheduler.waiting_grammars)

    def grammar_failures(self) -> list[Request]:
        """Waiting requests whose grammar failed to compile (or admits no token): aborted with its error."""
        if not self.scheduler.waiting_grammars:
            return []
        bad = [r for r in self.scheduler.waiting if r.grammar is not None and r.grammar.ready() and r.grammar.error]
        return [done for r in bad for done in self.abort([r.request_id], r.grammar.error)]

    def _drop_inflight(self) -> None:
        """Wait for the step launched ahead and discard it (none of its requests is running)."""
        (_, handle), self.inflight = self.inflight, None
        try:
            self.runner.collect(handle)
        except Exception:
            logger.exception("a discarded step launched ahead failed")

    def _check_stop(self, req: Request) -> bool:
        """Stop strings on `req`'s new text; True if it is finished. A failing check aborts it alone."""
        if self.detok is not None and req.params.stop and not req.finished:
            st = self.decode_state[req.request_id]
            try:
                self.detok.update(st, req.output_token_ids, req.params.stop,
                                  len(req.output_token_ids) > req.params.min_tokens)
            except Exception as e:
                logger.exception("request %s: detokenisation failed; aborting it", req.request_id)
                self.scheduler.abort(req, f"detokenisation failed: {type(e).__name__}: {e}")
            if st.stop_hit:
                self.scheduler.finish(req, "stop")
        return req.finished

    def _fail_step(self, so: SchedulerOutput, ahead: SchedulerOutput | None, err: Exception) -> list[Request]:
        """Abort the requests of a failed step (and of the step launched ahead of it, discarded)."""
        self.inflight = None
        ids = {c.request_id for c in so.chunks} | {c.request_id for c in (ahead.chunks if ahead else [])}
        forked = {f.dst_slot for f in so.forks}  # their state may be half copied
        victims = [r for r in self.requests.values()
                   if not r.finished and (r.request_id in ids or (r.slot is not None and r.slot in forked))]
        error = f"{type(err).__name__}: {err}"
        logger.error("step failed; aborting requests %s", ", ".join(r.request_id for r in victims),
                     exc_info=err)
        # requests its partial update finished are reported with the aborted ones
        done = [r for r in self.requests.values() if r.finished]
        for r in done:
            self.requests.pop(r.request_id)
        return done + self.abort([r.request_id for r in victims], error)

    def abort(self, request_ids: list[str], error: str) -> list[Request]:
        """Finish these requests (and their siblings not started yet) with reason "abort", releasing
        their slots and blocks; returns the ones this call finished. Unknown or finished ids are
        ignored. Their detokenizer state stays until `completion` reads it or `release` drops it."""
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.finished:
                continue
            family = [req] + req.siblings
            self.scheduler.abort(req, error)
            for r in family:
                self.requests.pop(r.request_id, None)
            done += family
        if self.inflight is not None and not self.scheduler.has_unfinished():
            self._drop_inflight()  # only aborted requests were in it
        return done

    def release(self, req: Request) -> None:
        """Forget a request that will never be read (its detokenizer state)."""
        self.decode_state.pop(req.request_id, None)

    def completion(self, req: Request, index: int) -> CompletionOutput:
        st = self.decode_state.pop(req.request_id)
        text = self.detok.finalize(st, req.output_token_ids) if self.detok is not None else ""
        return CompletionOutput(index, text, list(req.output_token_ids), req.finish_reason,
                                list(req.logprobs) if req.params.logprobs is not None else None, req.error)

"""The engine-core process: owns the LLM (model, scheduler, cache) and steps it.

Messages in (API process -> engine, one multiprocessing queue):
  ("add", rid, prompt_token_ids, SamplingParams)  -> replies ("added", rid, None) or ("added", rid, error)
  ("abort", rid)                                  -> the request's family is aborted and freed at once
  ("shutdown",)                                   -> the loop ends (the API process drains first)
Messages out (one queue): ("ready", info) once, then ("step", deltas, stats, prompt_logprobs) after every step
(and after an abort, so the freed cache shows at once), ("fatal", error, usage) if start-up fails (usage: a problem
the user can fix, a bad argument or a model that cannot be found, as the CLI's exit status 2).
A delta is (rid, sample index, new token ids, their logprob dicts or None, finish_reason, error): only the
tokens appended since the previous delta of that sample. prompt_logprobs: {rid: (the request's
prompt_logprobs list, its prompt tokens' ranks)} for each request whose leader's first delta is in this message
(complete by then: a request samples only once its whole prompt is prefilled). Invariant: every added request gets
exactly one delta with a finish_reason per sample, unless the process dies.
"""
from __future__ import annotations

import logging
import os
import queue
import signal
from dataclasses import dataclass, field

IDLE_WAIT_S = 0.5  # an idle engine blocks this long on its inbox, then reports its stats again


@dataclass
class _Family:
    reqs: list        # the engine's Requests of one API request (n samples, leader first)
    sent: list[int] = field(default_factory=list)  # tokens already reported, per sample
    done: list[bool] = field(default_factory=list)


def engine_main(llm_kwargs: dict, inbox, outbox, log_level: int = logging.INFO) -> None:
    """Entry point of the spawned process. It ignores SIGINT (a terminal's Ctrl-C reaches the whole
    process group): the API process drains the requests in flight, then sends "shutdown"."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(levelname)s %(asctime)s engine-core %(name)s: %(message)s")
    from deepinfer.llm import LLM

    try:
        llm = LLM(**llm_kwargs)
    except (ValueError, FileNotFoundError) as e:  # a bad flag, a model not found (ModelNotFoundError): the API
        # process reports it and exits
        outbox.put(("fatal", str(e), True))
        return
    except Exception as e:
        logging.getLogger(__name__).exception("engine start-up failed")
        outbox.put(("fatal", f"{type(e).__name__}: {e}", False))
        return
    outbox.put(("ready", engine_info(llm)))
    try:
        EngineLoop(llm, inbox, outbox).run()
    finally:
        llm.close()


def engine_info(llm) -> dict:
    """The "ready" message's payload: what the API process needs to know of the engine. `thinks` is False for
    the demo checkpoints, by name or path (trained on source code, they never open or close a thinking block)."""
    from deepinfer.tools.demo import is_demo_dir

    mcfg = llm.model.config
    return {"model_dir": str(llm.model_dir), "max_model_len": llm.max_model_len, "vocab_size": mcfg.vocab_size,
            "eos_token_id": mcfg.eos_token_id, "bos_token_id": mcfg.bos_token_id,
            "max_logprobs": llm.config.max_logprobs, "max_num_seqs": llm.config.max_num_seqs, "stats": _stats(llm),
            "thinks": not is_demo_dir(llm.model_dir)}


def _stats(llm) -> dict:
    stats = llm.cache_stats()
    stats.update({f"spec_{k}": v for k, v in llm.get_metrics().items() if isinstance(v, (int, float))})
    return stats


class EngineLoop:
    def __init__(self, llm, inbox, outbox):
        self.llm, self.inbox, self.outbox = llm, inbox, outbox
        self.families: dict[str, _Family] = {}
        self.running = True
        self.parent = os.getppid()  # the API process: when it is gone (killed), this loop ends

    def run(self) -> None:
        log = logging.getLogger(__name__)
        while self.running:
            if os.getppid() != self.parent:
                log.error("the API process is gone; the engine stops")
                return
            busy = self.llm.has_unfinished()
            changed = self._take_messages(block=not busy)
            if self.llm.has_unfinished():
                try:
                    self.llm.step()
                except Exception as e:  # a step EngineCore could not contain: fail its requests, keep serving
                    log.exception("engine step failed; aborting every request in flight")
                    self._abort_all(f"engine step failed: {type(e).__name__}: {e}")
                changed = True
            if changed:
                prompt: dict[str, list] = {}
                self.outbox.put(("step", self._deltas(prompt), _stats(self.llm), prompt))

    def _take_messages(self, block: bool) -> bool:
        """Handle every queued message (waiting up to IDLE_WAIT_S for one when `block`); True if any came."""
        got = False
        while True:
            try:
                msg = self.inbox.get(timeout=IDLE_WAIT_S) if block and not got else self.inbox.get_nowait()
            except queue.Empty:
                return got or block  # an idle engine reports its stats every IDLE_WAIT_S
            got = True
            self._handle(msg)

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "add":
            _, rid, ids, params = msg
            try:
                reqs = self.llm.add_request(ids, params)
            except ValueError as e:
                self.outbox.put(("added", rid, str(e).removeprefix("prompts[0]: ")))
                return
            self.families[rid] = _Family(reqs, [0] * len(reqs), [False] * len(reqs))
            self.outbox.put(("added", rid, None))
        elif kind == "abort":
            fam = self.families.get(msg[1])
            if fam is not None:
                self.llm.abort(fam.reqs, "aborted by the client")
        elif kind == "shutdown":
            self._abort_all("the server shut down")
            self.running = False

    def _abort_all(self, error: str) -> None:
        for fam in self.families.values():
            self.llm.abort([r for r in fam.reqs if not r.finished], error)

    def _deltas(self, prompt: dict[str, list] | None = None) -> list[tuple]:
        """The deltas since the last call; `prompt` (when given) gets the prompt_logprobs due with them."""
        out = []
        for rid, fam in list(self.families.items()):
            for j, r in enumerate(fam.reqs):
                if fam.done[j]:
                    continue
                n = len(r.output_token_ids)
                if n == fam.sent[j] and not r.finished:
                    continue
                lps = r.logprobs[fam.sent[j]:n] if r.params.logprobs is not None else None
                if prompt is not None and j == 0 and fam.sent[0] == 0 and r.prompt_logprobs is not None:
                    prompt[rid] = (r.prompt_logprobs, r.prompt_logprob_ranks)
                out.append((rid, j, r.output_token_ids[fam.sent[j]:n], lps, r.finish_reason if r.finished else None,
                            r.error))
                fam.sent[j], fam.done[j] = n, r.finished
            if all(fam.done):
                del self.families[rid]
        return out

"""Scheduler.waiting_grammars (what the per-step grammar checks scan instead of the whole queue) is
exactly the set of waiting requests that have a grammar, through admission, preemption, n > 1 forks that
wait, and finishing from the queue."""
import random

from deepinfer.engine.kv_manager import KVCacheManager
from deepinfer.engine.outputs import ModelOutput
from deepinfer.engine.request import Request, Status
from deepinfer.engine.scheduler import Scheduler
from deepinfer.sampling_params import SamplingParams
from test_structured_scheduler import FakeGrammar


def test_waiting_grammars_track_the_queue_through_random_workloads():
    rng = random.Random(0)
    # a small cache: admissions stall and running requests get preempted
    kv = KVCacheManager(num_slots=4, num_blocks={4: 12}, block_size=2)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=24, max_model_len=200)
    reqs, tok = [], 7
    for step in range(300):
        if rng.random() < 0.3 and len(reqs) < 60:
            n = rng.choice([1, 1, 2])
            r = Request(str(len(reqs)), [3] * rng.randint(1, 12),
                        SamplingParams(max_tokens=rng.randint(1, 30), ignore_eos=True, n=n))
            if rng.random() < 0.5:
                r.grammar = FakeGrammar([tok] * 40, compiled=rng.random() < 0.8)
            sibs = [Request(f"{r.request_id}.{j}", r.prompt_token_ids, r.params) for j in range(1, n)]
            for s in sibs:
                s.status = Status.FORKING
            r.siblings = sibs
            reqs.append(r)
            sched.add(r)
        for r in reqs:
            if r.grammar is not None and rng.random() < 0.2:
                r.grammar.compiled = True
        if rng.random() < 0.05 and sched.waiting:
            sched.abort(rng.choice(list(sched.waiting)), "dropped")
        so = sched.schedule()
        mo = ModelOutput({c.request_id: [tok] * c.num_samples for c in so.chunks if c.num_samples})
        sched.update(so, mo)
        assert sched.waiting_grammars == {r for r in sched.waiting if r.grammar is not None}, step
    assert sched.num_preemptions > 0 and any(r.finished for r in reqs)

"""Host cost of finding a request in the scheduler's running list: `req in running` over 256 requests, the
target last: Request (identity equality) against the same dataclass with field-by-field equality (Request's before be09dd8).

    PYTHONPATH=. python benchmarks/request_membership.py
"""
import dataclasses
import timeit

from deepinfer.engine.request import Request
from deepinfer.sampling_params import SamplingParams

ValueEq = dataclasses.dataclass(eq=True)(type("ValueEq", (Request,), {}))
for cls in (ValueEq, Request):
    reqs = [cls(str(i), list(range(100)), SamplingParams()) for i in range(256)]
    us = min(timeit.repeat(lambda: reqs[-1] in reqs, number=200, repeat=5)) / 200 * 1e6
    print(f"{cls.__name__:8s} eq={'fields' if cls is ValueEq else 'identity'}: {us:.1f} us per membership test")

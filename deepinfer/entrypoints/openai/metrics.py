"""Prometheus metrics (vLLM's names under the `deepinfer:` prefix), on a registry of the server's own.

Gauges mirror the engine's stats as of its last step; counters and histograms are recorded by the API
process as requests finish. Invariant: prompt_tokens_total and generation_tokens_total count exactly
the tokens of the requests counted in request_success_total.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# engine stats key -> (metric name, help); spec_* come from LLM.get_metrics when speculative decoding runs
_SPEC = {"spec_num_drafts": ("spec_decode_num_drafts", "Draft proposals made"),
         "spec_num_draft_tokens": ("spec_decode_num_draft_tokens", "Draft tokens proposed"),
         "spec_num_accepted_tokens": ("spec_decode_num_accepted_tokens", "Draft tokens accepted"),
         "spec_mean_acceptance_length": ("spec_decode_mean_acceptance_length",
                                         "Tokens per verification step, the target's own included"),
         "spec_num_preemptions": ("num_preemptions", "Requests preempted (their cache freed, recomputed later)")}


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        lbl, self.model_name = ["model_name"], model_name
        g = lambda n, h: Gauge(f"deepinfer:{n}", h, lbl, registry=r).labels(model_name)  # noqa: E731
        self.running = g("num_requests_running", "Requests in the engine's running batch")
        self.waiting = g("num_requests_waiting", "Requests waiting in the engine's queue")
        self.cache_usage = g("kv_cache_usage_perc", "Fraction of the cache's blocks in use (1 = full)")
        self.free_blocks = g("kv_cache_free_blocks", "Free cache blocks (all compression ratios)")
        self.total_blocks = g("kv_cache_total_blocks", "Cache blocks (all compression ratios)")
        self.in_flight = g("num_requests_in_flight", "Requests the API process holds (queued to stream back)")
        self.spec = {k: g(n, h) for k, (n, h) in _SPEC.items()}
        c = lambda n, h: Counter(f"deepinfer:{n}", h, lbl, registry=r).labels(model_name)  # noqa: E731
        self.prompt_tokens = c("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = c("generation_tokens", "Generated tokens of finished requests")
        self.success = Counter("deepinfer:request_success", "Finished requests by finish reason",
                               lbl + ["finished_reason"], registry=r)
        self.rejected = Counter("deepinfer:request_rejected", "Requests refused before running, by HTTP status",
                                lbl + ["status"], registry=r)
        h = lambda n, d, b: Histogram(f"deepinfer:{n}", d, lbl, buckets=b, registry=r).labels(model_name)  # noqa
        self.ttft = h("time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS)
        self.tpot = h("time_per_output_token_seconds", "Time per output token after the first", _TPOT_BUCKETS)
        self.e2e = h("e2e_request_latency_seconds", "End-to-end request latency", _LATENCY_BUCKETS)

    def update_engine(self, stats: dict) -> None:
        self.running.set(stats.get("num_running", 0))
        self.waiting.set(stats.get("num_waiting", 0))
        total = stats.get("total_blocks", 0)
        free = stats.get("free_blocks", 0)
        self.free_blocks.set(free)
        self.total_blocks.set(total)
        self.cache_usage.set(1 - free / total if total else 0.0)
        for k, gauge in self.spec.items():
            if k in stats:
                gauge.set(stats[k])

    def finished(self, reason: str, prompt_tokens: int, output_tokens: int, start: float, first: float | None,
                 end: float) -> None:
        """One sample of a request ended (times from time.monotonic)."""
        self.success.labels(self.model_name, reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(output_tokens)
        self.e2e.observe(end - start)
        if first is not None:
            self.ttft.observe(first - start)
            if output_tokens > 1:
                self.tpot.observe((end - first) / (output_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)

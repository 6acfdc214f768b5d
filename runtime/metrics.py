"""Prometheus metrics of the server: queue sizes, KV blocks, latencies, tokens."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TPOT = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class Metrics:
    def __init__(self, num_kv_blocks: int):
        r = self.registry = CollectorRegistry()
        self.running = Gauge("deepinfer_requests_running", "Sequences holding KV blocks", registry=r)
        self.waiting = Gauge("deepinfer_requests_waiting", "Sequences waiting for the scheduler", registry=r)
        self.kv_used = Gauge("deepinfer_kv_blocks_used", "KV blocks in use", registry=r)
        self.kv_total = Gauge("deepinfer_kv_blocks_total", "KV blocks in the compiled pool", registry=r)
        self.kv_total.set(num_kv_blocks)
        self.ttft = Histogram("deepinfer_time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY,
                              registry=r)
        self.tpot = Histogram("deepinfer_time_per_output_token_seconds", "Mean time per output token after the "
                              "first, per request", buckets=_TPOT, registry=r)
        self.e2e = Histogram("deepinfer_e2e_request_latency_seconds", "Arrival to last token", buckets=_LATENCY,
                             registry=r)
        self.generated = Counter("deepinfer_generation_tokens", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("deepinfer_prompt_tokens", "Prompt tokens accepted", registry=r)
        self.finished = Counter("deepinfer_requests_finished", "Finished sequences by reason", ["reason"],
                                registry=r)
        self.rejected = Counter("deepinfer_requests_rejected", "Refused requests by HTTP status", ["status"],
                                registry=r)
        self.step_seconds = Histogram("deepinfer_step_seconds", "Engine step wall time", buckets=_TPOT, registry=r)
        # as vLLM's prefix_cache_queries / prefix_cache_hits: hit rate = hits / queries
        self.cache_queries = Counter("deepinfer_prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                                     "at admission", registry=r)
        self.cache_hits = Counter("deepinfer_prefix_cache_hits", "Prompt tokens whose KV the prefix cache held",
                                  registry=r)
        self.kv_cached = Gauge("deepinfer_kv_blocks_cached", "KV blocks holding a registered prefix (in use or "
                               "evictable)", registry=r)
        # as vLLM's spec_decode_num_draft_tokens / _num_accepted_tokens: acceptance rate = accepted / draft
        self.spec_draft = Counter("deepinfer_spec_decode_num_draft_tokens", "Speculative (n-gram) draft tokens "
                                  "verified", registry=r)
        self.spec_accepted = Counter("deepinfer_spec_decode_num_accepted_tokens", "Speculative draft tokens "
                                     "accepted", registry=r)
        self._seen = (0, 0, 0, 0)

    def on_step(self, engine, outputs, seconds: float) -> None:
        """Runs on the engine thread after every step."""
        self._gauges(engine)
        self.step_seconds.observe(seconds)
        self.generated.inc(len(outputs))
        for out in outputs:
            if out.finished:
                self.observe_finished(out.seq)

    def on_abort(self, engine, seq) -> None:
        """Runs on the engine thread after an abort (an idle engine runs no step that would refresh the gauges)."""
        self.finished.labels("abort").inc()
        self._gauges(engine)

    def _gauges(self, engine) -> None:
        sched = engine.scheduler
        self.running.set(len(sched.running))
        self.waiting.set(len(sched.waiting))
        self.kv_used.set(sched.blocks.num_used)
        bm = sched.blocks
        self.kv_cached.set(bm.num_cached)
        q, h, d, a = self._seen
        self.cache_queries.inc(bm.queries - q)
        self.cache_hits.inc(bm.hits - h)
        self.spec_draft.inc(engine.num_draft_tokens - d)
        self.spec_accepted.inc(engine.num_accepted_tokens - a)
        self._seen = (bm.queries, bm.hits, engine.num_draft_tokens, engine.num_accepted_tokens)

    def observe_finished(self, seq) -> None:
        import time
        now = time.monotonic()
        self.finished.labels(seq.finish_reason or "unknown").inc()
        self.e2e.observe(now - seq.arrival)
        if seq.first_token_time is not None:
            self.ttft.observe(seq.first_token_time - seq.arrival)
            n = len(seq.output_ids)
            if n > 1:
                self.tpot.observe((now - seq.first_token_time) / (n - 1))

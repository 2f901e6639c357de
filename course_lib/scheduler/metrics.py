"""Prometheus metrics of the scheduler and the KV cache, with vLLM's names.

One :class:`Metrics` per engine, each with its own ``CollectorRegistry`` (never the global
default one), so that two engines -- or two tests -- never collide. The engine (or the
simulator) calls :meth:`Metrics.update` after each step and :meth:`Metrics.observe_finished`
for the requests that finished; :func:`serve_metrics` exposes ``/metrics`` over HTTP on
127.0.0.1 for ``curl`` or a Prometheus server.

Names as vLLM exports them (``vllm/engine/metrics.py``, ``vllm/v1/metrics/loggers.py``):

    vllm:num_requests_running / _waiting / _swapped      gauges
    vllm:gpu_cache_usage_perc / vllm:cpu_cache_usage_perc gauges, 0..1 (held blocks / total)
    vllm:num_preemptions_total                            counter
    vllm:prefix_cache_queries_total / _hits_total         counters, in tokens
    vllm:prompt_tokens_total / vllm:generation_tokens_total counters
    vllm:cache_config_info                                gauge = 1, the config in labels
    vllm:time_to_first_token_seconds                      histogram
    vllm:time_per_output_token_seconds                    histogram (v1: inter_token_latency)
    vllm:e2e_request_latency_seconds                      histogram
"""

from __future__ import annotations

from collections.abc import Iterable
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from ..sequence import Request
from .scheduler import Scheduler

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)


class Metrics:
    """The collectors of one engine, in ``self.registry``."""

    def __init__(self, scheduler: Scheduler, model_name: str = "course-model") -> None:
        self.registry = reg = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=reg)

        def counter(name: str, doc: str) -> Counter:   # exposed with a _total suffix
            return Counter(name, doc, labels, registry=reg)

        self.num_requests_running = gauge("vllm:num_requests_running",
                                          "Number of requests in the running batch.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting",
                                          "Number of requests waiting to be processed.")
        self.num_requests_swapped = gauge("vllm:num_requests_swapped",
                                          "Number of requests swapped to CPU.")
        self.gpu_cache_usage = gauge("vllm:gpu_cache_usage_perc",
                                     "GPU KV-cache usage. 1 means 100 percent usage.")
        self.cpu_cache_usage = gauge("vllm:cpu_cache_usage_perc",
                                     "CPU KV-cache usage. 1 means 100 percent usage.")
        self.num_preemptions = counter("vllm:num_preemptions",
                                       "Cumulative number of preemptions.")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries",
                                            "Prefix-cache queries, in prompt tokens.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits",
                                         "Prefix-cache hits, in prompt tokens.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.")
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", labels,
                              buckets=TTFT_BUCKETS, registry=reg)
        self.tpot = Histogram("vllm:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds.", labels,
                              buckets=TPOT_BUCKETS, registry=reg)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of end to end request latency in seconds.", labels,
                             buckets=E2E_BUCKETS, registry=reg)
        cc = scheduler.cache_config
        info = {"block_size": cc.block_size, "num_gpu_blocks": cc.num_gpu_blocks,
                "num_cpu_blocks": cc.num_cpu_blocks, "watermark": cc.watermark,
                "enable_prefix_caching": cc.enable_prefix_caching}
        cache_info = Gauge("vllm:cache_config_info", "Information of the KV-cache config.",
                           list(info), registry=reg)
        cache_info.labels(**{k: str(v) for k, v in info.items()}).set(1)
        self._seen = {"preemptions": 0, "queries": 0, "hits": 0, "prompt": 0, "generation": 0}
        self.update(scheduler)

    def update(self, scheduler: Scheduler) -> None:
        """Read the scheduler's queues and counters and the block manager's pools (after a
        step): the engine and the model-free replay feed the metrics the same way."""
        m, bm = self.model_name, scheduler.block_manager
        self.num_requests_running.labels(m).set(len(scheduler.running))
        self.num_requests_waiting.labels(m).set(len(scheduler.waiting))
        self.num_requests_swapped.labels(m).set(len(scheduler.swapped))
        self.gpu_cache_usage.labels(m).set(bm.usage("gpu").block_usage)
        self.cpu_cache_usage.labels(m).set(bm.usage("cpu").block_usage)
        stats = bm.prefix_cache_stats
        for key, now, counter in (("preemptions", scheduler.num_preemptions,
                                   self.num_preemptions),
                                  ("queries", stats.queries, self.prefix_cache_queries),
                                  ("hits", stats.hits, self.prefix_cache_hits),
                                  ("prompt", scheduler.num_prompt_tokens, self.prompt_tokens),
                                  ("generation", scheduler.num_generated_tokens,
                                   self.generation_tokens)):
            if now > self._seen[key]:
                counter.labels(m).inc(now - self._seen[key])
                self._seen[key] = now

    def observe_finished(self, requests: Iterable[Request]) -> None:
        """TTFT, TPOT and end-to-end latency of finished requests (ignored ones are skipped)."""
        m = self.model_name
        for req in requests:
            if req.first_token_time is None or req.finished_time is None:
                continue
            self.ttft.labels(m).observe(req.first_token_time - req.arrival_time)
            self.e2e.labels(m).observe(req.finished_time - req.arrival_time)
            if req.num_output_tokens > 1:
                self.tpot.labels(m).observe((req.finished_time - req.first_token_time)
                                            / (req.num_output_tokens - 1))

    def value(self, name: str) -> float:
        """One sample's current value, e.g. ``value("vllm:num_preemptions_total")``."""
        got = self.registry.get_sample_value(name, {"model_name": self.model_name})
        if got is None:
            names = sorted({s.name for f in self.registry.collect() for s in f.samples})
            raise ValueError(f"no sample {name!r}; samples: {names}")
        return got


def serve_metrics(metrics: Metrics, port: int = 0) -> tuple[WSGIServer, int]:
    """Serve ``/metrics`` on 127.0.0.1 (port 0: any free port) in a daemon thread.
    Returns the server (call ``server.shutdown()`` to stop it) and the port."""
    server, _thread = start_http_server(port, addr="127.0.0.1", registry=metrics.registry)
    return server, server.server_port

"""Prometheus metrics of the scheduler and the KV cache, with vLLM's names for each design.

One :class:`Metrics` per engine, each with its own registry (never prometheus_client's global
default one), so that two engines -- or two tests -- never collide. The engine calls
:meth:`Metrics.record_step` once per step, with everything the step changed, and
:meth:`Metrics.record_recovery` after it recovered from a failed step; the model-free replay
and the chapters may call the pieces one by one (:meth:`Metrics.update`,
:meth:`Metrics.observe_step`, :meth:`Metrics.observe_finished`, :meth:`Metrics.forget`).
:func:`serve_metrics` exposes ``/metrics`` over HTTP on 127.0.0.1 for ``curl`` or a Prometheus
server.

The names follow the design the engine runs. For both:

    vllm:num_requests_running / _waiting                   gauges
    vllm:num_preemptions_total                             counter
    vllm:prompt_tokens_total / vllm:generation_tokens_total counters
    vllm:cache_config_info                                 gauge = 1, the config in labels
    vllm:time_to_first_token_seconds                       histogram, per request
    vllm:e2e_request_latency_seconds                       histogram, per request

The paper's / vLLM V0's design (V0's ``vllm/engine/metrics.py``, removed from vLLM since):

    vllm:num_requests_swapped                              gauge
    vllm:gpu_cache_usage_perc / vllm:cpu_cache_usage_perc  gauges, 0..1 (held blocks / total)
    vllm:time_per_output_token_seconds                     histogram, per generated token
    vllm:gpu_prefix_cache_hit_rate                         gauge, hits / queries so far
                                                           (-1 with prefix caching off)

V0 (0.6.3's ``vllm/core/block/common.py`` CacheMetricData) counted its queries per block
lookup; the course counts them in prompt tokens, as V1 does, so both designs' rates agree.

vLLM V1 (``vllm/v1/metrics/loggers.py`` in vLLM 0.33.0; no swap, so no swapped requests and
no CPU usage; ``gpu_cache_usage_perc`` is gone, renamed):

    vllm:kv_cache_usage_perc                               gauge, 0..1
    vllm:prefix_cache_queries_total / _hits_total          counters, in prompt tokens
                                                           (a rate is a PromQL ratio)
    vllm:inter_token_latency_seconds                       histogram, per generated token
    vllm:request_time_per_output_token_seconds             histogram, per request

The course's own, in both designs (see :meth:`Metrics.record_recovery`):

    course:engine_recoveries_total                         counter, failed steps recovered
    course:recomputed_tokens_total                         counter, tokens recomputed by them

prometheus_client adds a ``*_created`` timestamp beside every counter and histogram; they are
not vLLM metrics, and the course turns them off so that ``/metrics`` shows vLLM's names only.
Every series exists from the start, at 0 (as vLLM creates its labelled series when the engine
starts), so that a ``rate()`` over a window that begins before the first preemption counts it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Metric,
    disable_created_metrics,
    generate_latest,
    make_wsgi_app,
)
from prometheus_client.exposition import ThreadingWSGIServer

from ..sequence import Request
from .scheduler import Scheduler
from .v1 import SchedulerV1

disable_created_metrics()

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)


class StepRegistry(CollectorRegistry):
    """A ``CollectorRegistry`` whose readers never see half of an apply.

    :class:`Metrics` holds ``lock`` while it applies one call's changes (a step's gauges,
    counters and histograms together); :meth:`collect` -- what a scrape, ``value()`` and
    ``get_sample_value`` read -- lists every family under the same lock. An apply is only
    ``set`` / ``inc`` / ``observe`` calls (about a microsecond each, one ``observe`` per token
    of the step), and the lock is not held while a scrape renders the text, so a scrape waits
    at most for one apply, never for a step, and a step waits at most for one collect (about
    half a millisecond for the course's families)."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        with self.lock:
            families = list(super().collect())
        return iter(families)

    def restricted_registry(self, names: Iterable[str]) -> _Collected:
        """What a ``/metrics?name[]=...`` scrape renders: the named families, also collected
        under the lock."""
        with self.lock:
            families = list(super().restricted_registry(names).collect())
        return _Collected(families)


@dataclass
class _Collected:
    """Families collected at one instant, for ``generate_latest`` to render."""
    families: list[Metric]

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


@dataclass
class _Changes:
    """Everything one call changes, read in full before any of it is applied: the
    collectors' children (``gauge.labels(model)``) with their new values, and this object's
    own maps."""
    sets: list[tuple[object, float]] = field(default_factory=list)          # gauge child, value
    incs: list[tuple[object, float]] = field(default_factory=list)          # counter child, > 0
    observations: list[tuple[object, float]] = field(default_factory=list)  # histogram child
    seen: dict[str, float] = field(default_factory=dict)     # the scheduler's counts, now seen
    clocks: dict[Request, float] = field(default_factory=dict)   # last token times, set ...
    drops: list[Request] = field(default_factory=list)           # ... then these dropped


class Metrics:
    """The collectors of one engine, in ``self.registry``; ``design`` ("v0" or "v1") picks the
    names (by default the scheduler's design).

    **Read everything, then apply once.** Every public method first reads what it needs from
    the scheduler and the requests (reads call the library's code and may raise: then nothing
    is applied), then applies all its changes in one :meth:`_apply`, which calls nothing of
    the library (only prometheus_client's ``set`` / ``inc`` / ``observe`` and dict updates),
    under the registry's lock. So a call is all or nothing: a fault raised anywhere in the
    library during :meth:`record_step` lands before anything is applied, and the step retried
    or recomputed after it observes each latency once. ``version`` counts the applies.
    """

    def __init__(self, scheduler: Scheduler | SchedulerV1, model_name: str = "course-model",
                 design: str | None = None) -> None:
        self.design = design or ("v1" if isinstance(scheduler, SchedulerV1) else "v0")
        if self.design not in ("v0", "v1"):
            raise ValueError(f"design must be 'v0' or 'v1', got {self.design!r}")
        self.registry = reg = StepRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        v0 = self.design == "v0"

        def gauge(name: str, doc: str) -> Gauge:
            g = Gauge(name, doc, labels, registry=reg)
            g.labels(model_name)                       # the series exists at 0 from the start
            return g

        def counter(name: str, doc: str) -> Counter:   # exposed with a _total suffix
            c = Counter(name, doc, labels, registry=reg)
            c.labels(model_name)
            return c

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            h = Histogram(name, doc, labels, buckets=buckets, registry=reg)
            h.labels(model_name)
            return h

        self.num_requests_running = gauge("vllm:num_requests_running",
                                          "Number of requests in the running batch.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting",
                                          "Number of requests waiting to be processed.")
        if v0:
            self.num_requests_swapped = gauge("vllm:num_requests_swapped",
                                              "Number of requests swapped to CPU.")
            self.gpu_cache_usage = gauge("vllm:gpu_cache_usage_perc",
                                         "GPU KV-cache usage. 1 means 100 percent usage.")
            self.cpu_cache_usage = gauge("vllm:cpu_cache_usage_perc",
                                         "CPU KV-cache usage. 1 means 100 percent usage.")
            self.prefix_cache_hit_rate = gauge("vllm:gpu_prefix_cache_hit_rate",
                                               "GPU prefix cache block hit rate.")
            self.prefix_cache_queries = self.prefix_cache_hits = None
        else:
            self.gpu_cache_usage = gauge("vllm:kv_cache_usage_perc",
                                         "KV-cache usage. 1 means 100 percent usage.")
            self.prefix_cache_queries = counter("vllm:prefix_cache_queries",
                                                "Prefix-cache queries, in prompt tokens.")
            self.prefix_cache_hits = counter("vllm:prefix_cache_hits",
                                             "Prefix-cache hits, in prompt tokens.")
        self.num_preemptions = counter("vllm:num_preemptions",
                                       "Cumulative number of preemptions.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.")
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        if v0:
            self.itl = histogram("vllm:time_per_output_token_seconds",
                                 "Histogram of time per output token in seconds.", TPOT_BUCKETS)
            self.request_tpot = None
        else:
            self.itl = histogram("vllm:inter_token_latency_seconds",
                                 "Histogram of inter-token latency in seconds.", TPOT_BUCKETS)
            self.request_tpot = histogram("vllm:request_time_per_output_token_seconds",
                                          "Histogram of time_per_output_token_seconds per "
                                          "request.", TPOT_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of end to end request latency in seconds.", E2E_BUCKETS)
        self.recoveries = counter("course:engine_recoveries",
                                  "Failed engine steps recovered by recompute.")
        self.recomputed_tokens = counter("course:recomputed_tokens",
                                         "Tokens recomputed after failed engine steps.")
        cc = scheduler.cache_config
        info = {"block_size": cc.block_size, "num_gpu_blocks": cc.num_gpu_blocks,
                "num_cpu_blocks": cc.num_cpu_blocks if v0 else 0,
                "watermark": cc.watermark, "enable_prefix_caching": cc.enable_prefix_caching}
        cache_info = Gauge("vllm:cache_config_info", "Information of the KV-cache config.",
                           list(info), registry=reg)
        cache_info.labels(**{k: str(v) for k, v in info.items()}).set(1)
        # The scheduler's cumulative counts as last applied: a counter grows by the difference
        # (a fresh scheduler after a recovery starts from these same counts: it adds nothing)
        self._seen = {"preemptions": 0, "queries": 0, "hits": 0, "prompt": 0, "generation": 0}
        # each request with a token so far -> its last token's time. Keyed by the Request
        # object itself (identity: ``Request`` is ``eq=False``), never by ``id(request)`` or
        # the request id, both of which a later request can reuse; the strong reference is
        # dropped however the request ends (see :meth:`forget`).
        self._last_token_time: dict[Request, float] = {}
        self._prefix_caching = cc.enable_prefix_caching
        self.version = 0                                # applies so far
        self.update(scheduler)

    # ------------------------------------------------------------------ a whole step
    def record_step(self, scheduler: Scheduler | SchedulerV1, sampled: Iterable[Request],
                    finished: Iterable[Request], now: float) -> None:
        """Everything one engine step changed, in one apply: the scheduler's gauges and
        counters (:meth:`update`), the inter-token latencies of ``sampled``, the requests that
        got a token in the step that ended at ``now`` (:meth:`observe_step`), and the TTFT,
        end-to-end latency and time per output token of ``finished``
        (:meth:`observe_finished`). A scrape sees the step whole or not at all."""
        changes = _Changes()
        self._read_scheduler(scheduler, changes)
        self._read_tokens(sampled, now, changes)
        self._read_finished(finished, changes)
        self._apply(changes)

    def record_recovery(self, scheduler: Scheduler | SchedulerV1, recomputed_tokens: int,
                        failed: Iterable[Request]) -> None:
        """The engine recovered from a failed step (nothing of it was recorded): the gauges
        of the fresh ``scheduler`` (every request back in the waiting queue, every block
        free), one more recovery, ``recomputed_tokens`` more tokens to recompute, and the
        requests that ended with an error (``failed``) forgotten. The others keep their
        inter-token clocks: their next token's latency includes the recovery, as a streaming
        client waits it. The fresh scheduler's cumulative counts are the ones last recorded,
        so its counters add nothing.

        These two counters are the course's own (``course:``): vLLM 0.33.0 has no such metric,
        because on an engine-core fault it recovers nothing -- it aborts every request
        (``vllm/v1/fault_tolerance/engine_core_sentinel.py``, ``EngineCoreSentinel.on_fault``:
        ``scheduler.finish_requests(None, FINISHED_ABORTED)``)."""
        changes = _Changes()
        self._read_scheduler(scheduler, changes)
        m = self.model_name
        changes.incs.append((self.recoveries.labels(m), 1))
        if recomputed_tokens > 0:
            changes.incs.append((self.recomputed_tokens.labels(m), recomputed_tokens))
        changes.drops.extend(failed)
        self._apply(changes)

    # ------------------------------------------------------------------ the pieces
    def update(self, scheduler: Scheduler | SchedulerV1) -> None:
        """Read the scheduler's queues and counters and the block manager's pools (after a
        step), and apply them."""
        changes = _Changes()
        self._read_scheduler(scheduler, changes)
        self._apply(changes)

    def observe_step(self, requests: Iterable[Request], now: float) -> None:
        """The requests that got a token in the step that ended at ``now``: each token after
        a request's first is an inter-token latency (what a streaming client waits).

        Then every request that has ended by now, however it ended (finished, aborted,
        ignored, failed), is forgotten, so the map holds only unfinished requests even if
        nobody called :meth:`forget` for them."""
        changes = _Changes()
        self._read_tokens(requests, now, changes)
        self._apply(changes)

    def observe_finished(self, requests: Iterable[Request]) -> None:
        """TTFT, end-to-end latency and (V1) time per output token of finished requests
        (ignored ones are skipped)."""
        changes = _Changes()
        self._read_finished(requests, changes)
        self._apply(changes)

    def forget(self, requests: Request | Iterable[Request]) -> None:
        """Drop requests that ended outside a step (aborted, failed alone): their
        inter-token clock stops. Requests never seen, or forgotten already, are fine."""
        changes = _Changes()
        changes.drops.extend([requests] if isinstance(requests, Request) else requests)
        self._apply(changes)

    # ------------------------------------------------------------------ read, then apply
    def _read_scheduler(self, scheduler: Scheduler | SchedulerV1, into: _Changes) -> None:
        m, bm = self.model_name, scheduler.block_manager
        into.sets += [(self.num_requests_running.labels(m), len(scheduler.running)),
                      # vLLM counts the requests waiting with blocks (for a KV connector's
                      # loads) as waiting too (get_request_counts: kv_holding_waiting)
                      (self.num_requests_waiting.labels(m), len(scheduler.waiting)
                       + len(getattr(scheduler, "waiting_for_remote", ()))),
                      (self.gpu_cache_usage.labels(m), bm.usage("gpu").block_usage)]
        stats = bm.prefix_cache_stats
        if self.design == "v0":
            rate = (-1.0 if not self._prefix_caching
                    else stats.hits / stats.queries if stats.queries else 0.0)
            into.sets += [(self.num_requests_swapped.labels(m), len(scheduler.swapped)),
                          (self.cpu_cache_usage.labels(m), bm.usage("cpu").block_usage),
                          (self.prefix_cache_hit_rate.labels(m), rate)]
        counts = [("preemptions", scheduler.num_preemptions, self.num_preemptions),
                  ("queries", stats.queries, self.prefix_cache_queries),
                  ("hits", stats.hits, self.prefix_cache_hits),
                  ("prompt", scheduler.num_prompt_tokens, self.prompt_tokens),
                  ("generation", scheduler.num_generated_tokens, self.generation_tokens)]
        for key, now, counter in counts:
            if counter is not None and now > self._seen[key]:   # never backwards
                into.incs.append((counter.labels(m), now - self._seen[key]))
                into.seen[key] = now

    def _read_tokens(self, requests: Iterable[Request], now: float, into: _Changes) -> None:
        itl, requests = self.itl.labels(self.model_name), list(dict.fromkeys(requests))
        for req in requests:                                  # once each, in order
            last = self._last_token_time.get(req)
            if last is not None:
                into.observations.append((itl, now - last))
            into.clocks[req] = now
        into.drops += [r for r in (*self._last_token_time, *requests) if r.is_finished]

    def _read_finished(self, requests: Iterable[Request], into: _Changes) -> None:
        m, requests = self.model_name, list(requests)
        for req in requests:
            if req.first_token_time is None or req.finished_time is None:
                continue                                      # ignored: never ran
            into.observations += [
                (self.ttft.labels(m), req.first_token_time - req.arrival_time),
                (self.e2e.labels(m), req.finished_time - req.arrival_time)]
            if self.request_tpot is not None and req.num_output_tokens > 1:
                into.observations.append(
                    (self.request_tpot.labels(m), (req.finished_time - req.first_token_time)
                     / (req.num_output_tokens - 1)))
        into.drops += requests

    def _apply(self, changes: _Changes) -> None:
        """Apply ``changes`` at once, under the registry's lock (no scrape collects
        meanwhile). Calls nothing of the library: a fault injected into it cannot land
        part-way through."""
        with self.registry.lock:
            for child, value in changes.sets:
                child.set(value)
            for child, amount in changes.incs:
                child.inc(amount)
            for child, value in changes.observations:
                child.observe(value)
            self._seen.update(changes.seen)
            self._last_token_time.update(changes.clocks)
            for req in changes.drops:
                self._last_token_time.pop(req, None)
            self.version += 1

    # ------------------------------------------------------------------ reading them
    def exposition(self) -> bytes:
        """The registry in the classic text format, names exactly as registered (colons
        kept): what a scrape of :func:`serve_metrics` answers."""
        return generate_latest(self.registry)

    def value(self, name: str) -> float:
        """One sample's current value, e.g. ``value("vllm:num_preemptions_total")``."""
        got = self.registry.get_sample_value(name, {"model_name": self.model_name})
        if got is None:
            names = sorted({s.name for f in self.registry.collect() for s in f.samples})
            raise ValueError(f"no sample {name!r}; samples: {names}")
        return got


# ----------------------------------------------------------------------- /metrics over HTTP
def classic_text_only(app: Callable) -> Callable:
    """The WSGI ``app`` with the request's ``Accept`` header removed: prometheus_client's app
    then answers the classic text format (``text/plain; version=0.0.4``), whatever the
    scraper asked for.

    Why: a Prometheus 2.x server (Debian's 2.42, say) asks for OpenMetrics first and names no
    escaping scheme, so recent prometheus_client (0.26 here) picks "underscores" escaping
    (which, by Prometheus' escaping rules, leaves ``:`` alone) and then writes
    ``# HELP vllm:gpu_cache_usage_perc`` but ``vllm_gpu_cache_usage_perc 0.5`` on the sample
    line (prometheus/client_python#1177; the fix proposed there escapes the HELP line too).
    Prometheus then stores every vLLM series with ``_`` for ``:``, and
    ``vllm:gpu_cache_usage_perc`` finds nothing. The classic text format has no escaping
    step, every Prometheus reads it, and it is what ``curl`` shows, so the names the course
    teaches are the names a Prometheus server stores. (vLLM 0.33.0 gets the same effect from
    the order of its routes, ``vllm/entrypoints/serve/instrumentator/metrics.py``.)"""
    def app_in_classic_text(environ: dict, start_response: Callable) -> Iterable[bytes]:
        environ.pop("HTTP_ACCEPT", None)
        return app(environ, start_response)
    return app_in_classic_text


class _QuietHandler(WSGIRequestHandler):
    """wsgiref's request handler without its log line per request on stderr
    (prometheus_client's ``start_wsgi_server`` silences it the same way, with a private
    class of its own)."""

    def log_message(self, format: str, *args: object) -> None:
        pass


class _MetricsServer(ThreadingWSGIServer):
    """prometheus_client's thread-per-request WSGI server, with a listen backlog of 128
    (socketserver's default is 5: a burst of scrapers beyond it waits for SYN retransmits,
    a second and more)."""

    request_queue_size = 128


def serve_metrics(metrics: Metrics, port: int = 0) -> tuple[WSGIServer, int]:
    """Serve ``metrics.registry`` over HTTP on 127.0.0.1 (``port`` 0: any free port) from a
    daemon thread, as prometheus_client's ``start_wsgi_server`` does: its WSGI app
    (``make_wsgi_app``) on its thread-per-request server, in the classic text format whatever
    is asked (:func:`classic_text_only`). Each scrape collects the registry under its lock
    (:class:`StepRegistry`: never half a step) and renders it in its own thread, so a slow
    client holds only its own thread. prometheus_client's app answers any path but
    ``/favicon.ico`` and only ``GET`` (and ``OPTIONS``); wsgiref answers a malformed request
    with a 400 and goes on serving.

    Returns the server (``server.shutdown()`` stops it, ``server.server_close()`` frees the
    port) and the port. A port in use raises ``OSError``."""
    app = classic_text_only(make_wsgi_app(metrics.registry))
    server = make_server("127.0.0.1", port, app, _MetricsServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-server", daemon=True).start()
    return server, server.server_port

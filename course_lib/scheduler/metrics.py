"""Prometheus metrics of the scheduler and the KV cache, with vLLM's names for each design.

One :class:`Metrics` per engine, each with its own ``CollectorRegistry`` (never the global
default one), so that two engines -- or two tests -- never collide. The engine (or the
simulator) calls :meth:`Metrics.update` after each step, :meth:`Metrics.observe_step` with the
requests that got a token in it, :meth:`Metrics.observe_finished` for the requests that
finished, and :meth:`Metrics.forget` for a request that ended outside a step (aborted, or
failed alone); :func:`serve_metrics` exposes ``/metrics`` over HTTP on 127.0.0.1 for ``curl`` or a
Prometheus server.

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

prometheus_client adds a ``*_created`` timestamp beside every counter and histogram; they are
not vLLM metrics, and the course turns them off so that ``/metrics`` shows vLLM's names only.
Every series exists from the start, at 0 (as vLLM creates its labelled series when the engine
starts), so that a ``rate()`` over a window that begins before the first preemption counts it.

:func:`serve_metrics` always answers in the classic text format (``text/plain;
version=0.0.4``), whatever the scraper asks for: see :func:`metrics_app` for why.
"""

from __future__ import annotations

import io
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from ..sequence import Request
from .scheduler import Scheduler
from .v1 import SchedulerV1

disable_created_metrics()

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)


class Metrics:
    """The collectors of one engine, in ``self.registry``; ``design`` ("v0" or "v1") picks the
    names (by default the scheduler's design). ``version`` counts the changes applied to
    them (by :meth:`update`, :meth:`observe_step`, :meth:`observe_finished`, :meth:`forget`):
    change the collectors through these only, and a scrape between two changes reuses the
    last body.

    **A step's changes are all or nothing.** Each of those methods first reads everything it
    needs (the reads can fail), then applies (collectors and this object's own maps). Between
    :meth:`begin` and :meth:`commit` (the engine's step) the applications wait and are made
    together at commit, or dropped by :meth:`discard` when the step is rolled back, so a
    retried step never observes a latency twice. Outside (the model-free replay) each call
    applies at once.
    """

    def __init__(self, scheduler: Scheduler | SchedulerV1, model_name: str = "course-model",
                 design: str | None = None) -> None:
        self.design = design or ("v1" if isinstance(scheduler, SchedulerV1) else "v0")
        if self.design not in ("v0", "v1"):
            raise ValueError(f"design must be 'v0' or 'v1', got {self.design!r}")
        self.registry = reg = CollectorRegistry()
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
        cc = scheduler.cache_config
        info = {"block_size": cc.block_size, "num_gpu_blocks": cc.num_gpu_blocks,
                "num_cpu_blocks": cc.num_cpu_blocks if v0 else 0,
                "watermark": cc.watermark, "enable_prefix_caching": cc.enable_prefix_caching}
        cache_info = Gauge("vllm:cache_config_info", "Information of the KV-cache config.",
                           list(info), registry=reg)
        cache_info.labels(**{k: str(v) for k, v in info.items()}).set(1)
        self._seen = {"preemptions": 0, "queries": 0, "hits": 0, "prompt": 0, "generation": 0}
        # each request with a token so far -> its last token's time. Keyed by the Request
        # object itself (identity: ``Request`` is ``eq=False``), never by ``id(request)`` or
        # the request id, both of which a later request can reuse; the strong reference is
        # dropped however the request ends (see :meth:`forget`).
        self._last_token_time: dict[Request, float] = {}
        self._prefix_caching = cc.enable_prefix_caching
        self.version = 0
        self._pending: list[Callable[[], object]] | None = None   # a step's, until commit
        self.update(scheduler)

    # ------------------------------------------------------- a step: all or nothing
    def begin(self) -> None:
        """A step begins: hold its changes until :meth:`commit` (or :meth:`discard`)."""
        self._pending = []

    def commit(self) -> None:
        """The step succeeded: apply the changes it held."""
        pending, self._pending = self._pending or [], None
        self._apply(pending)

    def discard(self) -> None:
        """The step was rolled back: drop the changes it held."""
        self._pending = None

    def _apply(self, changes: list[Callable[[], object]]) -> None:
        """Apply ``changes`` now, or hold them while a step is open."""
        if self._pending is not None:
            self._pending.extend(changes)
            return
        for change in changes:
            change()
        if changes:
            self.version += 1

    # ------------------------------------------------------------------ the readings
    def update(self, scheduler: Scheduler | SchedulerV1) -> None:
        """Read the scheduler's queues and counters and the block manager's pools (after a
        step): the engine and the model-free replay feed the metrics the same way."""
        m, bm = self.model_name, scheduler.block_manager
        gauges = [(self.num_requests_running, len(scheduler.running)),
                  # vLLM counts the requests waiting with blocks (for a KV connector's
                  # loads) as waiting too (get_request_counts: kv_holding_waiting)
                  (self.num_requests_waiting, len(scheduler.waiting)
                   + len(getattr(scheduler, "waiting_for_remote", ()))),
                  (self.gpu_cache_usage, bm.usage("gpu").block_usage)]
        stats = bm.prefix_cache_stats
        if self.design == "v0":
            rate = (-1.0 if not self._prefix_caching
                    else stats.hits / stats.queries if stats.queries else 0.0)
            gauges += [(self.num_requests_swapped, len(scheduler.swapped)),
                       (self.cpu_cache_usage, bm.usage("cpu").block_usage),
                       (self.prefix_cache_hit_rate, rate)]
        counts = [("preemptions", scheduler.num_preemptions, self.num_preemptions),
                  ("queries", stats.queries, self.prefix_cache_queries),
                  ("hits", stats.hits, self.prefix_cache_hits),
                  ("prompt", scheduler.num_prompt_tokens, self.prompt_tokens),
                  ("generation", scheduler.num_generated_tokens, self.generation_tokens)]

        def change() -> None:
            for gauge, value in gauges:
                gauge.labels(m).set(value)
            for key, now, counter in counts:
                if counter is not None and now > self._seen[key]:
                    counter.labels(m).inc(now - self._seen[key])
                    self._seen[key] = now
        self._apply([change])

    def observe_step(self, requests: Iterable[Request], now: float) -> None:
        """The requests that got a token in the step that ended at ``now``: each token after
        a request's first is an inter-token latency (what a streaming client waits).

        Then every request that has ended by now, however it ended (finished, aborted,
        ignored, failed), is forgotten, so the map holds only unfinished requests even if
        nobody called :meth:`forget` for them."""
        m, requests = self.model_name, list(dict.fromkeys(requests))   # once each, in order
        ended = [r for r in (*self._last_token_time, *requests) if r.is_finished]

        def change() -> None:
            for req in requests:
                last = self._last_token_time.get(req)
                if last is not None:
                    self.itl.labels(m).observe(now - last)
                self._last_token_time[req] = now
            for req in ended:
                self._last_token_time.pop(req, None)
        self._apply([change])

    def forget(self, requests: Request | Iterable[Request]) -> None:
        """Drop requests that ended outside a step's update (aborted, failed alone): their
        inter-token clock stops. Requests never seen, or forgotten already, are fine."""
        requests = [requests] if isinstance(requests, Request) else list(requests)

        def change() -> None:
            for req in requests:
                self._last_token_time.pop(req, None)
        self._apply([change])

    def observe_finished(self, requests: Iterable[Request]) -> None:
        """TTFT, end-to-end latency and (V1) time per output token of finished requests
        (ignored ones are skipped)."""
        m, requests, seen = self.model_name, list(requests), []
        for req in requests:
            if req.first_token_time is None or req.finished_time is None:
                continue
            tpot = None
            if self.request_tpot is not None and req.num_output_tokens > 1:
                tpot = (req.finished_time - req.first_token_time) / (req.num_output_tokens - 1)
            seen.append((req.first_token_time - req.arrival_time,
                         req.finished_time - req.arrival_time, tpot))

        def change() -> None:
            for req in requests:
                self._last_token_time.pop(req, None)
            for ttft, e2e, tpot in seen:
                self.ttft.labels(m).observe(ttft)
                self.e2e.labels(m).observe(e2e)
                if tpot is not None:
                    self.request_tpot.labels(m).observe(tpot)
        self._apply([change])

    def value(self, name: str) -> float:
        """One sample's current value, e.g. ``value("vllm:num_preemptions_total")``."""
        got = self.registry.get_sample_value(name, {"model_name": self.model_name})
        if got is None:
            names = sorted({s.name for f in self.registry.collect() for s in f.samples})
            raise ValueError(f"no sample {name!r}; samples: {names}")
        return got


CLASSIC_TEXT = "text/plain; version=0.0.4; charset=utf-8"

WSGIApp = Callable[[dict, Callable], list[bytes]]


def classic_text(registry: CollectorRegistry) -> bytes:
    """The registry in the classic text format, names exactly as registered (colons kept)."""
    try:
        return generate_latest(registry, escaping="allow-utf-8")
    except TypeError:          # prometheus_client before UTF-8 names: it never escapes names
        return generate_latest(registry)


def metrics_app(registry: CollectorRegistry,
                version: Callable[[], object] | None = None) -> WSGIApp:
    """A WSGI app: ``GET /metrics`` (or ``/``) answers the registry in the classic text format
    whatever the ``Accept`` header says; any other path is a 404.

    ``version`` (e.g. ``lambda: metrics.version``): a value that changes whenever the
    registry does; the body is then generated once per version and shared by the scrapes
    in between (generating it is pure Python, about a millisecond: a burst of scrapers would
    otherwise queue behind it). It is tagged with the version read *before* generating, so
    a change made meanwhile is never hidden.

    Why not prometheus_client's own app: it negotiates the format. A Prometheus 2.x server
    (Debian's 2.42, say) asks for OpenMetrics first and names no escaping scheme, so recent
    prometheus_client (0.26 here) picks "underscores" escaping (which, by Prometheus' escaping
    rules, leaves ``:`` alone) and then writes ``# HELP vllm:gpu_cache_usage_perc`` but
    ``vllm_gpu_cache_usage_perc 0.5`` on the sample line (prometheus/client_python#1177; the
    fix proposed there escapes the HELP line too). Prometheus
    then stores every vLLM series with ``_`` for ``:``, and ``vllm:gpu_cache_usage_perc`` finds
    nothing. The classic text format has no escaping step, every Prometheus reads it (it is the
    one format all versions accept), and it is what ``curl`` shows, so the names the course
    teaches are the names a Prometheus server stores.
    """
    cached: list[tuple[object, bytes]] = []          # [(version, body)]: the last one

    def app(environ: dict, start_response: Callable) -> list[bytes]:
        if environ.get("PATH_INFO", "/") not in ("/", "/metrics"):
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"not found: only /metrics is served\n"]
        now = version() if version is not None else None
        last = cached[-1] if cached else None
        if last is not None and now is not None and last[0] == now:
            body = last[1]
        else:
            body = classic_text(registry)
            if now is not None:
                cached[:] = [(now, body)]
        start_response("200 OK", [("Content-Type", CLASSIC_TEXT),
                                  ("Content-Length", str(len(body)))])
        return [body]
    return app


class _DeadlineReader(io.RawIOBase):
    """A connection's socket, read until a deadline: each read may wait only for the time
    left, so a client that trickles its request a byte at a time is cut off at the deadline
    (``TimeoutError``), where a per-read timeout would wait for it forever."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self._sock, self._deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the client did not send its request in time")
        self._sock.settimeout(left)          # the answer's sendall gets what is left, too
        return self._sock.recv_into(buffer)


class _QuietHandler(WSGIRequestHandler):
    """No line on stderr per request (a notebook cell or a terminal stays readable), and one
    deadline per connection: a client has ``timeout`` seconds in all to send its request (and
    take its answer), however it trickles it, so that no client holds a thread longer."""

    timeout = 10

    def setup(self) -> None:
        super().setup()
        self.rfile.close()                   # the plain socket file: replaced by a timed one
        self.rfile = io.BufferedReader(
            _DeadlineReader(self.connection, time.monotonic() + self.timeout))

    def log_message(self, format: str, *args: object) -> None:
        pass


class _MetricsServer(WSGIServer):
    """The WSGI server with one thread per connection (what the standard library's
    ``ThreadingMixIn`` adds, written out here: one class, no mixin): a slow client holds its
    own thread (until its deadline, :class:`_QuietHandler`), never the scrapes of the others.
    A listen backlog of 128 (socketserver's default is 5: a burst of scrapers beyond it waits
    for SYN retransmits, 1 s and more). Threads are daemons, so ``server_close()`` does not
    wait for them. A client that times out or drops its connection is not worth a
    traceback."""

    request_queue_size = 128

    def process_request(self, request: socket.socket, client_address: object) -> None:
        """Answer the connection in a thread of its own (socketserver calls this per accept)."""
        threading.Thread(target=self._answer, args=(request, client_address),
                         daemon=True).start()

    def _answer(self, request: socket.socket, client_address: object) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)

    def handle_error(self, request: object, client_address: object) -> None:
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


def serve_metrics(metrics: Metrics, port: int = 0) -> tuple[WSGIServer, int]:
    """Serve ``/metrics`` (classic text format, see :func:`metrics_app`) on 127.0.0.1 (port 0:
    any free port): a daemon thread accepts connections and each is answered in a thread of
    its own, so concurrent scrapers do not queue behind each other or behind a slow client;
    the body is generated again only once ``metrics`` changed (:func:`metrics_app`). Returns
    the server (``server.shutdown()`` stops it, ``server.server_close()`` frees the port) and
    the port. A port in use raises ``OSError``."""
    server = make_server("127.0.0.1", port,
                         metrics_app(metrics.registry, lambda: metrics.version),
                         server_class=_MetricsServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-server", daemon=True).start()
    return server, server.server_port

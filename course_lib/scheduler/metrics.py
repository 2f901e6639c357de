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
version=0.0.4``), whatever the scraper asks for: see :class:`MetricsServer` for why. A scrape
reads :meth:`Metrics.exposition`: the text as of the end of the last change applied (never
half a step's changes), rendered once per change and never waiting for a step.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable
from email.utils import formatdate
from urllib.parse import urlsplit

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
    last body (:meth:`exposition`).

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
        self._applying = False                 # True while _apply changes the collectors
        self._pending: list[Callable[[], object]] | None = None   # a step's, until commit
        self.update(scheduler)
        self._exposition = (self.version, classic_text(reg))   # (version, body): consistent

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
        if not changes:
            return
        self._applying = True        # a scrape rendering now may see half: it will not keep it
        try:
            for change in changes:
                change()
        finally:
            self.version += 1        # before the flag drops: see exposition()
            self._applying = False

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

    def exposition(self) -> bytes:
        """The registry in the classic text format (:func:`classic_text`) as of the end of
        the last change applied: what a scrape answers. It takes no lock, so it never waits
        for a step to end, and it never shows part of a change (in the engine,
        a whole step's changes are one, applied at its commit).

        Rendered at most once per :attr:`version` (pure Python, about a millisecond: a burst
        of scrapers would otherwise each pay it). A scrape that finds a change being applied
        gets the last body at once. A render is kept only if no change was applied while it
        ran (``version`` and ``_applying`` read before and after, a seqlock: ``_apply``
        raises ``_applying`` first and bumps ``version`` before dropping it); else the last
        body is answered: collectors read mid-change are never served. Either way the
        answer is at most the changes of that instant behind."""
        last_version, last_body = self._exposition
        version = self.version
        if version == last_version or self._applying:
            return last_body
        body = classic_text(self.registry)
        if self._applying or self.version != version:       # a change ran meanwhile
            return last_body
        self._exposition = (version, body)
        return body

    def value(self, name: str) -> float:
        """One sample's current value, e.g. ``value("vllm:num_preemptions_total")``."""
        got = self.registry.get_sample_value(name, {"model_name": self.model_name})
        if got is None:
            names = sorted({s.name for f in self.registry.collect() for s in f.samples})
            raise ValueError(f"no sample {name!r}; samples: {names}")
        return got


CLASSIC_TEXT = "text/plain; version=0.0.4; charset=utf-8"
# one non-blocking socket call without a mode switch (an fcntl, and a release of the
# interpreter lock, saved per connection); where it is missing, sockets are made non-blocking
_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)


def classic_text(registry: CollectorRegistry) -> bytes:
    """The registry in the classic text format, names exactly as registered (colons kept)."""
    try:
        return generate_latest(registry, escaping="allow-utf-8")
    except TypeError:          # prometheus_client before UTF-8 names: it never escapes names
        return generate_latest(registry)


class _Connection:
    """One client's connection in :class:`MetricsServer`'s loop: the request head read so
    far, then the answer left to send, and the deadline for both."""

    __slots__ = ("sock", "deadline", "head", "out", "draining", "event")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline = sock, deadline
        self.head = b""            # the request's bytes so far (up to the blank line)
        self.out = b""             # the answer's bytes not sent yet
        self.draining = False      # answered; reading what the client sent beyond its head
        self.event = 0             # what it waits for in the selector (0: not registered)


class MetricsServer:
    """``/metrics`` over HTTP on 127.0.0.1, in one thread: a ``selectors`` loop accepts
    connections, reads each request head, and answers ``GET /metrics`` (or ``/``) with
    ``page()`` (e.g. :meth:`Metrics.exposition`) in the classic text format, whatever the
    ``Accept`` header says; ``HEAD`` gets the headers only, another path a 404, another
    method a 405, a malformed request a 400 and a head over 8 KiB a 431. One request per
    connection (``Connection: close``).

    Why one thread and no ``http.server``: the costs of a scrape are the HTTP handling (the
    body is rendered once per change) and, beside a pure-Python step (the model-free
    replay), the interpreter lock: every socket call releases it, and taking it back from a
    busy thread waits up to the switch interval (5 ms). ``wsgiref`` spent about 0.8 ms of
    Python per scrape (headers parsed by ``email``, a WSGI environ, five ``sendall``) in a
    thread of its own, about a dozen lock releases; here a scrape whose request has arrived
    is an ``accept``, a ``recv``, one ``send`` and a ``close`` (no selector registration),
    and the loop serves every ready connection per wake-up. The body is rendered in the
    loop (about a millisecond, once per change: every connection waits that long, as it
    would for the interpreter lock). A slow client holds nothing: its socket waits in the
    selector, and it has ``request_deadline_s`` seconds in all (however it trickles its
    request, or reads its answer) before it is dropped unanswered. A listen backlog of 128
    (socketserver's default is 5: a burst of scrapers beyond it waits for SYN retransmits,
    1 s and more).

    Why the classic text format whatever is asked (not prometheus_client's own app, which
    negotiates): a Prometheus 2.x server (Debian's 2.42, say) asks for OpenMetrics first and
    names no escaping scheme, so recent prometheus_client (0.26 here) picks "underscores"
    escaping (which, by Prometheus' escaping rules, leaves ``:`` alone) and then writes
    ``# HELP vllm:gpu_cache_usage_perc`` but ``vllm_gpu_cache_usage_perc 0.5`` on the sample
    line (prometheus/client_python#1177; the fix proposed there escapes the HELP line too).
    Prometheus then stores every vLLM series with ``_`` for ``:``, and
    ``vllm:gpu_cache_usage_perc`` finds nothing. The classic text format has no escaping
    step, every Prometheus reads it (it is the one format all versions accept), and it is
    what ``curl`` shows, so the names the course teaches are the names a Prometheus server
    stores.

    ``serve_forever()`` runs the loop (:func:`serve_metrics` starts it in a daemon thread);
    ``shutdown()`` stops it and waits; ``server_close()`` frees the port.
    """

    request_deadline_s = 10.0      # a client's whole time to send its request and take the answer
    max_head_bytes = 8192
    request_queue_size = 128

    def __init__(self, port: int, page: Callable[[], bytes]) -> None:
        self.page = page
        self.socket = socket.create_server(("127.0.0.1", port),
                                           backlog=self.request_queue_size)
        self.socket.setblocking(False)
        self.server_port: int = self.socket.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()   # shutdown() wakes the loop
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._stopped.set()                                # not running yet

    # ------------------------------------------------------------------ the loop
    def serve_forever(self) -> None:
        """Serve until :meth:`shutdown` (in the calling thread)."""
        self._stopped.clear()
        conns: dict[int, _Connection] = {}
        sel = selectors.DefaultSelector()
        sel.register(self.socket, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                wait = min((c.deadline for c in conns.values()), default=None)
                if wait is not None:
                    wait = max(0.0, wait - time.monotonic())
                for key, _ in sel.select(wait):
                    if key.fileobj is self.socket:
                        self._accept(sel, conns)
                    elif key.fileobj is not self._wake_r:
                        self._serve(sel, conns, conns[key.fd])
                now = time.monotonic()
                for conn in [c for c in conns.values() if c.deadline <= now]:
                    self._drop(sel, conns, conn)       # too slow: dropped unanswered
        finally:
            for conn in list(conns.values()):
                self._drop(sel, conns, conn)
            sel.close()
            self._stopped.set()

    def _accept(self, sel: selectors.BaseSelector, conns: dict[int, _Connection]) -> None:
        """Accept every connection waiting in the backlog, and serve each at once: its request
        is usually there already, and then it is answered and closed without ever entering
        the selector (four socket calls in all)."""
        deadline = time.monotonic() + self.request_deadline_s
        while True:
            try:
                sock, _ = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:                    # e.g. out of file descriptors: try later
                return
            if not _DONTWAIT:
                sock.setblocking(False)
            conn = _Connection(sock, deadline)
            conns[sock.fileno()] = conn
            self._serve(sel, conns, conn)

    def _serve(self, sel: selectors.BaseSelector, conns: dict[int, _Connection],
               conn: _Connection) -> None:
        """Read more of the request, send more of the answer, or drain, whichever is due;
        what would block waits in the selector (never in a socket call: each is
        ``MSG_DONTWAIT``).

        Closing a socket with unread bytes resets the connection, and a reset can destroy
        the answer before the client read it: when the client sent more than its head (a
        body, or a head cut at ``max_head_bytes``), the answer is followed by a half-close
        and the rest is read and dropped until the client closes (or its deadline)."""
        try:
            if not conn.out:
                if conn.draining:
                    if not conn.sock.recv(65536, _DONTWAIT):
                        self._drop(sel, conns, conn)
                    return
                got = conn.sock.recv(self.max_head_bytes + 1, _DONTWAIT)
                if not got:                    # the client left before its request ended
                    self._drop(sel, conns, conn)
                    return
                conn.head += got
                end = conn.head.find(b"\r\n\r\n")
                if end < 0 and len(conn.head) <= self.max_head_bytes:
                    self._wait(sel, conn, selectors.EVENT_READ)   # more to come
                    return
                conn.out = self._answer(conn.head, end)
                conn.draining = end < 0 or len(conn.head) > end + 4   # more than the head
            sent = conn.sock.send(conn.out, _DONTWAIT)
            conn.out = conn.out[sent:]
            if conn.out:                       # the rest when the client's window opens
                self._wait(sel, conn, selectors.EVENT_WRITE)
                return
            if not conn.draining:
                self._drop(sel, conns, conn)
                return
            conn.sock.shutdown(socket.SHUT_WR)
            self._wait(sel, conn, selectors.EVENT_READ)
        except (BlockingIOError, InterruptedError):
            self._wait(sel, conn, selectors.EVENT_WRITE if conn.out else selectors.EVENT_READ)
        except OSError:                        # reset by the client: nothing to answer
            self._drop(sel, conns, conn)

    @staticmethod
    def _wait(sel: selectors.BaseSelector, conn: _Connection, event: int) -> None:
        """Let ``conn`` wait in the selector for ``event`` (registered on first need only)."""
        if conn.event == event:
            return
        if conn.event:
            sel.modify(conn.sock, event)
        else:
            sel.register(conn.sock, event)
        conn.event = event

    def _answer(self, head: bytes, end: int) -> bytes:
        """The whole answer to a request head (``end``: where its blank line is, -1 if the
        head was cut at ``max_head_bytes``)."""
        if end < 0:
            return self._response("431 Request Header Fields Too Large", b"request head too "
                                  b"large\n")
        parts = head[:head.find(b"\r\n")].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return self._response("400 Bad Request", b"bad request line\n")
        method, target = parts[0], parts[1]
        if urlsplit(target).path not in (b"/", b"/metrics"):
            return self._response("404 Not Found", b"not found: only /metrics is served\n")
        if method not in (b"GET", b"HEAD"):
            return self._response("405 Method Not Allowed", b"only GET and HEAD\n",
                                  extra="Allow: GET, HEAD\r\n")
        return self._response("200 OK", self.page(), CLASSIC_TEXT, head_only=method == b"HEAD")

    @staticmethod
    def _response(status: str, body: bytes, ctype: str = "text/plain; charset=utf-8",
                  extra: str = "", head_only: bool = False) -> bytes:
        head = (f"HTTP/1.1 {status}\r\nDate: {formatdate(usegmt=True)}\r\n"
                f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\n{extra}"
                f"Connection: close\r\n\r\n").encode("ascii")
        return head if head_only else head + body

    @staticmethod
    def _drop(sel: selectors.BaseSelector, conns: dict[int, _Connection],
              conn: _Connection) -> None:
        conns.pop(conn.sock.fileno(), None)
        if conn.event:
            sel.unregister(conn.sock)
            conn.event = 0
        conn.sock.close()

    # ------------------------------------------------------------------ control
    def shutdown(self) -> None:
        """Stop :meth:`serve_forever` and wait until it has returned (open connections are
        closed unanswered)."""
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._stopped.wait()

    def server_close(self) -> None:
        """Free the port (after :meth:`shutdown`)."""
        self.socket.close()
        self._wake_r.close()
        self._wake_w.close()


def serve_metrics(metrics: Metrics, port: int = 0) -> tuple[MetricsServer, int]:
    """Serve ``/metrics`` (classic text format, see :class:`MetricsServer`) on 127.0.0.1 (port
    0: any free port) from a daemon thread: each scrape answers
    :meth:`Metrics.exposition`, rendered once per change, never waiting for a step; a slow
    client holds no other scrape. Returns the server (``server.shutdown()`` stops it,
    ``server.server_close()`` frees the port) and the port. A port in use raises
    ``OSError``."""
    server = MetricsServer(port, metrics.exposition)
    threading.Thread(target=server.serve_forever, name="metrics-server", daemon=True).start()
    return server, server.server_port

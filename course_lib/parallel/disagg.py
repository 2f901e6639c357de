"""Prefill/decode disaggregation on real processes: ``x`` prefill engines and ``y`` decode
engines (``xPyD``), each a process with its own model, block pool and KV cache, joined by
``torch.distributed``, and a proxy in the caller's process that routes requests.

It is vLLM's disaggregated serving in miniature (vLLM 0.33.0's proxy examples under
``examples/online_serving/disaggregated_serving/`` and the NIXL connector's protocol, which
:mod:`course_lib.engine.p2p_connector` follows):

* the proxy sends a request to a prefill engine with ``max_tokens=1`` and
  ``kv_transfer_params={"do_remote_decode": True}``;
* the prefill engine's output carries ``kv_transfer_params`` (where its blocks wait); the proxy
  sends the original request, with them, to a decode engine;
* the decode engine pulls the blocks over ``torch.distributed``, computes the prompt's last
  token and decodes; its output is the request's.

Control travels on ``multiprocessing`` pipes (vLLM's proxy speaks HTTP to the engines); the K/V
travels only between the engines.

Devices and the data path (``device=``, :attr:`DisaggCluster.data_backend`):

* ``device="cpu"``: every engine on the CPU. ``"cuda"``: engine rank ``r`` on
  ``cuda:(r % torch.cuda.device_count())`` (``torch.cuda.set_device``), several engines
  sharing a GPU when there are fewer GPUs than engines. ``"auto"``: ``"cuda"`` when CUDA is
  available, else ``"cpu"``.
* The world group of all engines is gloo, always: it carries the connector's control messages
  (layouts at connect time, read requests, statuses: small CPU tensors).
* Right after joining the world, every rank makes, in the same order, one group per
  (prefill, decode) pair, ``dist.new_group([p, d], backend=data_backend)``; the K/V layer
  messages of that pair go on it (:mod:`course_lib.engine.p2p_transport`, *Where the bytes
  travel*, says why one group per pair is safe for NCCL). ``data_backend`` is ``"nccl"`` when
  every engine is on CUDA and there is a GPU per engine (chapter 09's rule,
  :func:`course_lib.parallel.launch.pick_backend`: NCCL cannot put two ranks on one GPU):
  the blocks go GPU to GPU. Otherwise it is ``"gloo"``: on the CPU the layers are CPU
  tensors anyway; engines sharing one GPU stage them through CPU memory (gathered and copied
  to the CPU, sent, copied back to the GPU). The pair groups time out after
  :data:`PAIR_TIMEOUT_S`, and NCCL's engine processes run with ``TORCH_NCCL_BLOCKING_WAIT=1``,
  so a dead peer is a failed transfer (recovered below), not a hang. **Only the CPU path is
  tested on this course's machine**: the NCCL path, and CUDA at all, are unverified here
  (their tests in ``tests/test_disagg.py`` skip without GPUs).

Processes are started as :mod:`course_lib.parallel.launch` starts ranks (``spawn``, a watchdog
that kills a process whose parent is gone, and their whole process groups killed on
:meth:`DisaggCluster.close`): no orphans, whatever happens.

Faults: an engine process that dies is noticed by the proxy (its pipe closes). A request it
was serving is sent again, from its prompt, to a live engine of the same role (a decode engine
asked for blocks its prefill engine no longer holds computes them itself: the request is
recomputed), or fails alone (``finish_reason="error"``) when no engine of that role is left.
The survivors free what they held for it (:mod:`course_lib.engine.p2p_connector`).

An engine that stops answering without dying (a stopped process, a stuck loop, a partition)
is treated the same way within a bounded time, its **lease** (``lease_s``, 30 s by default,
the default of vLLM 0.33.0's ``kv_lease_duration`` in ``vllm/distributed/kv_transfer/
kv_connector/v1/nixl/base_scheduler.py``, which bounds how long a prefill engine holds blocks
for a decode engine that stopped asking): every engine's loop tells the proxy it is alive
every ``lease_s / 6`` seconds (NIXL's heartbeat interval is ``kv_lease_duration // 6`` too);
one the proxy has not heard from for ``lease_s`` is **fenced**: the proxy kills its process
group and treats it as dead. Killing it, rather than only routing around it, is what bounds
every other wait: its connections close, so a peer blocked on one of its messages (on the
world group, whose message timeout is long because a prefill engine's listener waits for
read requests for as long as the cluster lives) fails at once, and it can never come back
with blocks or answers nobody expects. Inside the engines no transfer waits longer than
``lease_s`` either (the connector's ``transfer_timeout_s``), and a layer that fails to send
fails that transfer only (:mod:`course_lib.engine.p2p_transport`, *Failures*).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from multiprocessing.connection import wait
from typing import Any

from ..config import CacheConfig, SchedulerConfig
from ..engine.outputs import RequestOutput
from ..sequence import SamplingParams, finite_float, is_int, token_ids_or_error
from .launch import _die_with_parent, _kill_group, free_port

ROLES = ("kv_producer", "kv_consumer")
#: how long one gloo message may wait for its peer. The prefill engines' threads wait for read
#: requests for as long as the cluster lives (a learner may pause for an hour), so this is long:
#: it cannot double as a bound on a silent peer, because gloo closes a pair whose receive times
#: out (torch 2.13's gloo says "Application timeout caused pair closure", and every later
#: message on that pair fails), so an idle listener would lose its peer. A peer that dies is
#: noticed at once anyway (its connection closes), one that stops answering is fenced after its
#: lease (module docstring, *Faults*), which closes its connections, and the proxy bounds
#: starting and each generate() by its own timeout_s.
MESSAGE_TIMEOUT_S = 24 * 3600.0
#: how long one K/V layer message on a pair group may wait. The layers follow a status the
#: peer just sent on the world group, so a live peer is already sending: a short timeout is
#: safe, and it is what turns a dead NCCL peer (NCCL waits, it does not notice) into an error.
PAIR_TIMEOUT_S = 60.0
#: how long the proxy waits without a word from an engine before it fences it (module
#: docstring); vLLM 0.33.0's kv_lease_duration default
LEASE_S = 30.0
DEVICES = ("cpu", "cuda", "auto")


def resolve_device(device: str) -> str:
    """``"cpu"`` or ``"cuda"`` for a ``device`` argument (``"auto"``: CUDA when available);
    ``ValueError`` for anything else, or for ``"cuda"`` without CUDA."""
    import torch

    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device='cuda' but CUDA is not available (torch {torch.__version__}); "
                         "use device='cpu' or 'auto'")
    return device


def data_backend_for(devices: Sequence[str]) -> str:
    """The pair groups' backend for engines on ``devices`` (one per rank): ``"nccl"`` when
    every engine is on CUDA with a GPU of its own, else ``"gloo"`` (module docstring)."""
    import torch

    if devices and all(d == "cuda" for d in devices) and \
            torch.cuda.device_count() >= len(devices):
        return "nccl"
    return "gloo"


@dataclass
class EngineSpec:
    """What one engine process runs: its role and rank, its configs, its model dtype, its
    device (``"cpu"`` or ``"cuda"``: rank ``r`` then runs on ``cuda:(r % device_count)``), the
    backend of its K/V pair groups (the same for every engine: :func:`data_backend_for`) and
    how long one of their messages may wait in this process (``pair_timeout_s``), its lease
    (``lease_s``: it says it is alive every sixth of it; a transfer may take that long), and
    optional faults (``exit_after_layers``: it exits once its first transfer moved that many
    layers; ``fail_layer_send``: its n-th layer send fails once,
    :class:`~course_lib.engine.p2p_transport.P2PTransport`)."""

    rank: int
    kv_role: str
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig | None     # None: the engine's default
    dtype: str = "float32"
    attn_impl: str = "auto"
    exit_after_layers: int | None = None
    abort_timeout_s: float = 120.0
    device: str = "cpu"
    data_backend: str = "gloo"
    pair_timeout_s: float = PAIR_TIMEOUT_S
    fail_layer_send: int | None = None
    lease_s: float = LEASE_S


@dataclass
class Hop:
    """One moment of a request's path: when (seconds since the cluster started, one clock
    for all processes: ``time.monotonic``), where (``"proxy"``, ``"prefill 0"``, ...) and
    what."""

    t: float
    where: str
    what: str


@dataclass
class _Route:
    request_id: int
    prompt: list[int]
    params: SamplingParams
    prefill: int | None = None
    decode: int | None = None
    kv_transfer_params: dict | None = None
    pause: bool = False              # wait for resume() before the decode engine
    prefilled: bool = False
    hops: list[Hop] = field(default_factory=list)


class EngineDied(RuntimeError):
    """An engine process ended without being asked to (the message says which and how)."""


def _engine_main(spec: EngineSpec, world_size: int, roles: dict[int, str], port: int,
                 conn: Any, parent_pid: int) -> None:
    """Body of one engine process: pick its device, join the world, make the pair groups,
    build the engine and its connector, meet the peers, then serve the proxy's messages and
    step while there is work."""
    _die_with_parent(parent_pid)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if spec.data_backend == "nccl":
        # read when a NCCL group is made: a timed-out wait raises in its thread (a failed
        # transfer) instead of a watchdog tearing the process down (p2p_transport's docstring)
        os.environ["TORCH_NCCL_BLOCKING_WAIT"] = "1"
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
    try:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        from ..engine.llm_engine import LLMEngine
        from ..engine.p2p_connector import P2PConnector
        from ..engine.p2p_transport import P2PTransport
        from ..model.loader import load_tiny_model

        torch.set_num_threads(1)
        device = torch.device("cpu")
        if spec.device == "cuda":
            device = torch.device("cuda", spec.rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=spec.rank, world_size=world_size,
                                timeout=timedelta(seconds=MESSAGE_TIMEOUT_S))
        groups = _pair_groups(spec.rank, roles, spec.data_backend, spec.pair_timeout_s)
        model = load_tiny_model(device=device, dtype=getattr(torch, spec.dtype))
        transport = P2PTransport(spec.rank, data_groups=groups, data_backend=spec.data_backend,
                                 exit_after_layers=spec.exit_after_layers,
                                 fail_layer_send=spec.fail_layer_send)
        connector = P2PConnector(spec.kv_role, transport, abort_timeout_s=spec.abort_timeout_s,
                                 transfer_timeout_s=spec.lease_s)
        engine = LLMEngine(model, spec.scheduler_config, spec.cache_config,
                           attn_impl=spec.attn_impl, design="v1", kv_connector=connector)
        connector.connect(roles)
        conn.send(("ready", spec.rank))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        os._exit(1)
    seq_of: dict[int, int] = {}          # seq id -> request id, for the events
    said_alive = 0.0
    while True:
        if time.monotonic() - said_alive > spec.lease_s / 6:    # the lease (module docstring)
            said_alive = time.monotonic()
            conn.send(("alive", said_alive))
        while conn.poll():
            msg = conn.recv()
            if msg[0] == "add":
                _, rid, prompt, params, kv_params = msg
                try:
                    engine.add_request(prompt, params, request_id=rid,
                                       kv_transfer_params=kv_params)
                    seq_of[engine._requests[rid].seqs[0].seq_id] = rid
                except Exception as exc:               # a bad request fails alone
                    conn.send(("rejected", rid, f"{type(exc).__name__}: {exc}"))
            elif msg[0] == "release":
                connector.release(msg[1])
            elif msg[0] == "stats":
                conn.send(("stats", _stats(engine, connector)))
            elif msg[0] == "close":
                conn.send(("closed", spec.rank))
                os._exit(0)
        connector.serve_transfers()
        if connector.events:                  # to the proxy, then forgotten here
            events = connector.events[:]
            del connector.events[:len(events)]
            conn.send(("events", [(t, what, seq_of.get(s, -1)) for t, what, s in events]))
        if engine.has_unfinished_requests() or connector.busy():
            for out in engine.step():
                conn.send(("output", out, time.monotonic()))
            if not engine.last_output or not engine.last_output.scheduled:
                time.sleep(0.002)                 # only transfers to watch: do not spin
        else:
            conn.poll(0.01)


def _pair_groups(rank: int, roles: dict[int, str], backend: str, timeout_s: float
                 ) -> dict[int, Any]:
    """Every rank makes every (prefill, decode) pair's group, in one order (``new_group`` is
    collective over the world: a rank outside the pair calls it too); this rank's, by peer."""
    from datetime import timedelta

    import torch.distributed as dist

    prefill = sorted(r for r, role in roles.items() if role == ROLES[0])
    decode = sorted(r for r, role in roles.items() if role == ROLES[1])
    groups = {}
    for p in prefill:
        for d in decode:
            group = dist.new_group([p, d], backend=backend,
                                   timeout=timedelta(seconds=timeout_s))
            if rank in (p, d):
                groups[d if rank == p else p] = group
    return groups


def _stats(engine: Any, connector: Any) -> dict[str, Any]:
    import torch.distributed as dist

    kvm = engine.scheduler.kv_cache_manager
    transport = connector.transport
    engine.check_invariants()
    return {"device": str(engine.runner.device), "data_backend": transport.data_backend,
            "data_groups": {peer: dist.get_process_group_ranks(g)
                            for peer, g in (transport.data_groups or {}).items()},
            "layer_messages": dict(transport.layer_messages),
            "num_gpu_blocks": kvm.num_gpu_blocks, "num_free_blocks": kvm.num_free_gpu_blocks,
            "num_held_requests": connector.num_held_requests,
            "num_delayed_frees": len(kvm.delayed_frees),
            "num_sent_blocks": connector.num_sent_blocks,
            "num_recv_blocks": connector.num_recv_blocks,
            "num_failed_sends": connector.num_failed_sends,
            "num_failed_recvs": connector.num_failed_recvs,
            "num_aborted": connector.num_aborted,
            "num_unfinished": int(engine.has_unfinished_requests())}


#: the fields of :class:`EngineSpec` an override may change (rank, role and data backend are
#: the cluster's to set: a rank given another role or rank would not find its peers)
OVERRIDABLE = ("block_size", "dtype", "attn_impl", "device", "scheduler_config",
               "exit_after_layers", "fail_layer_send", "abort_timeout_s", "pair_timeout_s")
DTYPES = ("float32", "float64", "float16", "bfloat16")


def _check_engine_fields(rank: int | None, fields: Any) -> dict[str, Any]:
    """``ValueError`` naming the engine and the field for an override the engine process
    would fail on (or, worse, start with), before any process starts; the fields with their
    numbers as plain ints and floats (numbers are taken by value)."""
    from ..kernels.backends import ATTN_BACKENDS

    where = "DisaggCluster" if rank is None else f"overrides[{rank}]"
    if not isinstance(fields, dict):
        raise ValueError(f"{where} must be a dict of EngineSpec fields, got {fields!r}")
    unknown = sorted(set(fields) - set(OVERRIDABLE))
    if unknown:
        raise ValueError(f"{where} names {unknown}; an override may change {OVERRIDABLE}")

    def bad(name: str, value: Any, valid: str) -> ValueError:
        return ValueError(f"{where}: {name} must be {valid}, got {value!r:.60}")

    out = dict(fields)
    for name, value in fields.items():
        if name == "dtype" and value not in DTYPES:
            raise bad(name, value, f"one of {DTYPES}")
        if name == "attn_impl" and value not in ATTN_BACKENDS:
            raise bad(name, value, f"one of {ATTN_BACKENDS}")
        if name in ("exit_after_layers", "fail_layer_send") and value is not None:
            if not is_int(value) or value < 1:
                raise bad(name, value, "None or an int >= 1")
            out[name] = int(value)
        if name in ("abort_timeout_s", "pair_timeout_s"):
            out[name] = _seconds(value)
            if out[name] is None:
                raise bad(name, value, "a number of seconds > 0")
        if name == "scheduler_config" and not (value is None
                                               or isinstance(value, SchedulerConfig)):
            raise bad(name, value, "None or a SchedulerConfig")
    return out


def _seconds(value: Any) -> float | None:
    """``value`` as a finite float > 0 (any real number, by value), or None."""
    try:
        seconds = finite_float(value, "seconds")
    except ValueError:
        return None
    return seconds if seconds > 0 else None


class DisaggCluster:
    """``num_prefill`` prefill engines and ``num_decode`` decode engines on their own
    processes (module docstring), and the proxy that routes requests among them.

    ``overrides``: rank -> fields of :class:`EngineSpec` to change for that engine (a
    ``block_size`` there changes its ``cache_config``): to build mismatched engines, or a
    fault (``exit_after_layers``). Prefill engines are ranks ``0 .. num_prefill - 1``.
    ``timeout_s``: how long starting, and each :meth:`generate`, may take. ``lease_s``: how
    long an engine may stay silent before the proxy fences it (module docstring, *Faults*);
    it also bounds each transfer and each K/V layer message. ``device``:
    ``"cpu"``, ``"cuda"`` or ``"auto"`` (module docstring, *Devices and the data path*);
    :attr:`data_backend` and :meth:`data_path` say what the K/V travels on. Every argument
    is checked (``ValueError`` naming it) before any process starts: an engine process takes
    seconds to start and would report a bad one only then.

    Use it as a context manager (``with DisaggCluster(1, 1) as c: c.generate(...)``), or call
    :meth:`close`."""

    def __init__(self, num_prefill: int = 1, num_decode: int = 1, *,
                 cache_config: CacheConfig | None = None,
                 scheduler_config: SchedulerConfig | None = None, attn_impl: str = "auto",
                 overrides: dict[int, dict[str, Any]] | None = None,
                 timeout_s: float = 120.0, lease_s: float = LEASE_S,
                 device: str = "auto") -> None:
        for name, n in (("num_prefill", num_prefill), ("num_decode", num_decode)):
            if not is_int(n) or not 1 <= n <= 4:
                raise ValueError(f"{name} must be an int in 1..4 (processes on this machine), "
                                 f"got {n!r:.60}")
        num_prefill, num_decode = int(num_prefill), int(num_decode)
        seconds = _seconds(timeout_s)
        if seconds is None:
            raise ValueError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r:.60}")
        timeout_s = seconds
        lease = _seconds(lease_s)
        if lease is None:
            raise ValueError(f"lease_s must be a number of seconds > 0, got {lease_s!r:.60}")
        if cache_config is not None and not isinstance(cache_config, CacheConfig):
            raise ValueError(f"cache_config must be None or a CacheConfig, got "
                             f"{type(cache_config).__name__} {cache_config!r:.60}")
        device = resolve_device(device)
        cache_config = cache_config or CacheConfig(block_size=16, num_gpu_blocks=256,
                                                   enable_prefix_caching=True)
        if not cache_config.enable_prefix_caching or cache_config.prefix_cache != "hash":
            raise ValueError("disaggregation runs V1's KVCacheManager: give a CacheConfig with "
                             "enable_prefix_caching=True and prefix_cache='hash'")
        if cache_config.kv_offloading_size is not None:
            raise ValueError(f"cache_config sets kv_offloading_size="
                             f"{cache_config.kv_offloading_size!r}, a CPU tier, which is a KV "
                             f"connector; a disaggregated engine's connector is its "
                             f"P2PConnector, and an engine has one: give a CacheConfig "
                             f"without kv_offloading_size")
        world = num_prefill + num_decode
        if overrides is not None and not isinstance(overrides, dict):
            raise ValueError(f"overrides must be None or a dict rank -> fields, got "
                             f"{overrides!r:.60}")
        bad = [r for r in overrides or {} if not (is_int(r) and 0 <= r < world)]
        if bad:
            raise ValueError(f"overrides name ranks {bad}; the ranks are 0..{world - 1}")
        _check_engine_fields(None, {"attn_impl": attn_impl,
                                    "scheduler_config": scheduler_config})
        overrides = {int(rank): _check_engine_fields(rank, fields)
                     for rank, fields in (overrides or {}).items()}
        self.specs = []
        for rank in range(world):
            spec = EngineSpec(rank, ROLES[rank >= num_prefill], cache_config,
                              scheduler_config, attn_impl=attn_impl, device=device,
                              pair_timeout_s=min(PAIR_TIMEOUT_S, lease), lease_s=lease)
            fields = dict(overrides.get(rank, {}))
            if "block_size" in fields:
                spec.cache_config = replace(cache_config, block_size=fields.pop("block_size"))
            if "device" in fields:
                fields["device"] = resolve_device(fields["device"])
            self.specs.append(replace(spec, **fields))
        #: the pair groups' backend, the same on every engine: "gloo" or "nccl"
        self.data_backend = data_backend_for([s.device for s in self.specs])
        self.specs = [replace(s, data_backend=self.data_backend) for s in self.specs]
        self.num_prefill, self.num_decode = num_prefill, num_decode
        self.timeout_s = timeout_s
        self.lease_s = lease
        self.roles = {s.rank: s.kv_role for s in self.specs}
        self.prefill_ranks = list(range(num_prefill))
        self.decode_ranks = list(range(num_prefill, world))
        self.dead: dict[int, str] = {}
        self.routes: dict[int, _Route] = {}
        self._results: dict[int, RequestOutput] = {}
        self._next_id = 0
        self._rr = {"kv_producer": 0, "kv_consumer": 0}
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._heard: dict[int, float] = {}        # rank -> when it last said it was alive
        self._stats: dict[int, dict[str, Any]] = {}
        self._t0 = time.monotonic()
        self._start()

    # ---------------------------------------------------------------- processes
    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        try:
            for spec in self.specs:
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_engine_main, daemon=True,
                                   name=f"{spec.kv_role}-{spec.rank}",
                                   args=(spec, len(self.specs), self.roles, port, child,
                                         os.getpid()))
                proc.start()
                child.close()
                self._procs.append(proc)
                self._conns.append(parent)
            deadline = time.monotonic() + self.timeout_s
            ready: set[int] = set()
            errors: list[str] = []
            while len(ready) + len(errors) < len(self.specs):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"engines {sorted(set(range(len(self.specs))) - ready)} "
                                       f"did not start within {self.timeout_s} s")
                for c in wait(self._conns, timeout=min(left, 0.5)):
                    rank = self._conns.index(c)
                    try:
                        msg = c.recv()
                    except (EOFError, OSError):
                        errors.append(f"rank {rank} exited while starting "
                                      f"(code {self._procs[rank].exitcode})")
                        continue
                    if msg[0] == "ready":
                        ready.add(rank)
                        self._heard[rank] = time.monotonic()
                    elif msg[0] == "alive":           # a ready one, while others start
                        self._heard[rank] = msg[1]
                    else:
                        errors.append(f"rank {rank}: {msg[1]}")
                if errors:
                    break
            if errors:
                first = min(errors, key=lambda e: "ValueError" not in e)   # the cause first
                raise ValueError(first.split("\nTraceback")[0]) if "ValueError" in first \
                    else EngineDied(first)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop every engine process and its process group (idempotent)."""
        for rank, c in enumerate(self._conns):
            if rank not in self.dead:
                try:
                    c.send(("close",))
                except (OSError, ValueError):
                    pass
        end = time.monotonic() + 5
        for p in self._procs:
            p.join(timeout=max(0.0, end - time.monotonic()))
        for p in self._procs:
            _kill_group(p)
            p.join(timeout=1)
        for c in self._conns:
            c.close()
        self._procs, self._conns = [], []

    def __enter__(self) -> DisaggCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def data_path(self) -> str:
        """What the K/V travels on, in words: ``"nccl (GPU to GPU)"``, ``"gloo (staged
        through CPU memory)"`` (engines on a shared GPU) or ``"gloo (CPU memory)"``."""
        if self.data_backend == "nccl":
            return "nccl (GPU to GPU)"
        if any(s.device == "cuda" for s in self.specs):
            return "gloo (staged through CPU memory)"
        return "gloo (CPU memory)"

    def alive(self) -> list[int]:
        return [r for r, p in enumerate(self._procs) if p.is_alive() and r not in self.dead]

    # ------------------------------------------------------------------ requests
    def _pick(self, role: str) -> int | None:
        ranks = [r for r in (self.prefill_ranks if role == ROLES[0] else self.decode_ranks)
                 if r not in self.dead]
        if not ranks:
            return None
        i = self._rr[role] % len(ranks)
        self._rr[role] += 1
        return ranks[i]

    def _now(self) -> float:
        return time.monotonic() - self._t0

    def _hop(self, route: _Route, where: str, what: str, t: float | None = None) -> None:
        route.hops.append(Hop(self._now() if t is None else t - self._t0, where, what))

    def _where(self, rank: int) -> str:
        return (f"prefill {rank}" if rank in self.prefill_ranks
                else f"decode {rank - self.num_prefill}")

    def _send_prefill(self, route: _Route) -> bool:
        rank = self._pick(ROLES[0])
        if rank is None:
            return False
        route.prefill, route.decode = rank, None
        one = route.params.max_tokens == 1          # nothing to decode elsewhere
        params = route.params if one else replace(route.params, max_tokens=1)
        self._conns[rank].send(("add", route.request_id, route.prompt, params,
                                None if one else {"do_remote_decode": True}))
        self._hop(route, "proxy", f"sent to {self._where(rank)}")
        return True

    def _send_decode(self, route: _Route) -> bool:
        rank = self._pick(ROLES[1])
        if rank is None:
            return False
        route.decode = rank
        self._conns[rank].send(("add", route.request_id, route.prompt, route.params,
                                route.kv_transfer_params))
        self._hop(route, "proxy", f"sent to {self._where(rank)}")
        return True

    @staticmethod
    def _check_request(prompt: Any, params: Any) -> tuple[list[int], SamplingParams]:
        """A prompt (token ids >= 0, at least one; the engines check them against their
        vocabulary) and its ``SamplingParams`` (None: the defaults, n=1, no beam search), or
        ``ValueError`` naming the bad one."""
        ids = list(token_ids_or_error(prompt, what="prompt"))
        if not ids:
            raise ValueError("the prompt must hold at least one token")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be None or a SamplingParams, got "
                             f"{type(params).__name__} {params!r:.60}")
        if params.n != 1 or params.use_beam_search:
            raise ValueError("disaggregated requests have n=1 and no beam search, got "
                             f"n={params.n}, use_beam_search={params.use_beam_search}")
        return ids, params

    def _route(self, request_id: Any) -> _Route:
        if not is_int(request_id) or request_id not in self.routes:
            known = f"0..{self._next_id - 1}" if self._next_id else "none yet"
            raise ValueError(f"request {request_id!r:.60} was never submitted (submitted: "
                             f"{known})")
        return self.routes[request_id]

    def submit(self, prompt: Sequence[int], params: SamplingParams | None = None, *,
               pause_after_prefill: bool = False) -> int:
        """Send one prompt (token ids) to a prefill engine; its request id. With
        ``pause_after_prefill`` the proxy keeps the prefill engine's answer until
        :meth:`resume` (to look at the cluster while the blocks wait). Checked before
        anything is sent (``ValueError``)."""
        prompt, params = self._check_request(prompt, params)
        if not isinstance(pause_after_prefill, bool):
            raise ValueError(f"pause_after_prefill must be a bool, got "
                             f"{pause_after_prefill!r:.60}")
        route = _Route(self._next_id, prompt, params, pause=pause_after_prefill)
        self._next_id += 1
        self.routes[route.request_id] = route
        if not self._send_prefill(route):
            self._results[route.request_id] = self._failed(route, "no prefill engine is alive")
        return route.request_id

    def resume(self, request_id: int) -> None:
        """Send a request paused after its prefill on to a decode engine."""
        route = self._route(request_id)
        if not route.pause:
            raise ValueError(f"request {request_id} was not paused")
        route.pause = False
        if route.prefilled and request_id not in self._results:
            self._forward(route)

    def wait(self, request_ids: Sequence[int], *, prefilled: bool = False
             ) -> list[RequestOutput | None]:
        """Serve the engines' messages until the requests finished (or, with ``prefilled``,
        until their prefill finished: None for those); their outputs in order."""
        request_ids = [self._route(r).request_id for r in request_ids]

        def ready(rid: int) -> bool:
            return rid in self._results or (prefilled and self.routes[rid].prefilled)
        deadline = time.monotonic() + self.timeout_s
        while not all(ready(r) for r in request_ids):
            if time.monotonic() > deadline:
                raise TimeoutError(f"requests {[r for r in request_ids if not ready(r)]} did "
                                   f"not finish within {self.timeout_s} s")
            self._pump(0.5)
        return [self._results.get(r) for r in request_ids]

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run the prompts (token ids) through the cluster; their outputs in order. A request
        whose engines died is retried on live ones, or fails alone (module docstring). Every
        prompt and ``SamplingParams`` is checked before the first is sent."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise ValueError(f"prompts must be a list of prompts (token ids), got "
                             f"{type(prompts).__name__} {prompts!r:.60}")
        if isinstance(params, SamplingParams) or params is None:
            params = [params] * len(prompts)
        elif isinstance(params, (str, bytes)) or not isinstance(params, Sequence):
            raise ValueError(f"params must be None, a SamplingParams or a list of them (one "
                             f"per prompt), got {type(params).__name__} {params!r:.60}")
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            try:
                self._check_request(prompt, p)
            except ValueError as exc:
                raise ValueError(f"prompt {i}: {exc}") from None
        ids = [self.submit(prompt, p) for prompt, p in zip(prompts, params, strict=True)]
        return self.wait(ids)

    def _pump(self, timeout: float) -> None:
        """Take in what the engines said (waiting up to ``timeout`` for the first word), every
        message of each, then deal with the engines that died or stopped answering."""
        live = [c for r, c in enumerate(self._conns) if r not in self.dead]
        for c in wait(live, timeout=timeout):
            rank = self._conns.index(c)
            try:
                while rank not in self.dead and c.poll():
                    self._handle(rank, c.recv())
            except (EOFError, OSError):
                self._engine_died(rank)
        for rank in [r for r, p in enumerate(self._procs)
                     if r not in self.dead and not p.is_alive()]:
            self._engine_died(rank)
        now = time.monotonic()
        for rank in [r for r in self._heard if r not in self.dead]:
            if now - self._heard[rank] > self.lease_s and not self._conns[rank].poll():
                self._fence(rank)

    def _fence(self, rank: int) -> None:
        """An engine silent for longer than its lease: killed, then dealt with as dead."""
        _kill_group(self._procs[rank])
        self._engine_died(rank, f"stopped answering for longer than its lease "
                                f"({self.lease_s:g} s) and was killed")

    def _handle(self, rank: int, msg: tuple) -> None:
        results = self._results
        kind = msg[0]
        if kind == "alive":
            self._heard[rank] = max(self._heard.get(rank, 0.0), msg[1])
        elif kind == "stats":
            self._stats[rank] = msg[1]
        elif kind == "events":
            for t, what, rid in msg[1]:
                if rid in self.routes:
                    self._hop(self.routes[rid], self._where(rank), what, t)
        elif kind == "rejected":
            _, rid, why = msg
            results[rid] = self._failed(self.routes[rid], f"{self._where(rank)}: {why}")
        elif kind == "output":
            _, out, t = msg
            route = self.routes[out.request_id]
            if rank in self.prefill_ranks and route.decode is None:
                self._hop(route, self._where(rank), "prefill done, first token sampled", t)
                route.prefilled = True
                if out.kv_transfer_params is None:       # it ended there (stop, or 1 token)
                    results[out.request_id] = out
                    return
                route.kv_transfer_params = out.kv_transfer_params
                if not route.pause:
                    self._forward(route)
            else:
                self._hop(route, self._where(rank), "finished", t)
                results[out.request_id] = out

    def _forward(self, route: _Route) -> None:
        if not self._send_decode(route):
            self._results[route.request_id] = self._failed(route, "no decode engine is alive")

    def _engine_died(self, rank: int, how: str | None = None) -> None:
        proc, results = self._procs[rank], self._results
        proc.join(timeout=1)
        how = how or f"died, exit code {proc.exitcode}"
        self.dead[rank] = f"{self._where(rank)} (rank {rank}) {how}"
        for route in self.routes.values():
            if route.request_id in results:
                continue
            if route.decode == rank:        # again on another decode engine: it recomputes
                self._hop(route, "proxy", self.dead[rank])
                if not self._send_decode(route):
                    results[route.request_id] = self._failed(route, self.dead[rank] +
                                                             "; no decode engine is left")
            elif route.prefill == rank and route.decode is None:
                self._hop(route, "proxy", self.dead[rank])
                route.prefilled = False
                if not self._send_prefill(route):
                    results[route.request_id] = self._failed(route, self.dead[rank] +
                                                             "; no prefill engine is left")

    def _failed(self, route: _Route, why: str) -> RequestOutput:
        """The request fails alone; a prefill engine still holding its blocks lets them go."""
        self._hop(route, "proxy", "failed: " + why)
        params = route.kv_transfer_params
        if params is not None and route.prefill not in self.dead:
            self._conns[route.prefill].send(("release", [params["remote_request_id"]]))
        return RequestOutput(route.request_id, route.prompt, [], 0, 0, None, None,
                             finish_reason="error", finish_detail=why)

    # -------------------------------------------------------------------- inspect
    def stats(self) -> dict[int, dict[str, Any]]:
        """Per live engine: its device, its K/V data path (``data_backend``; ``data_groups``:
        peer -> the ranks of the pair's group, as ``torch.distributed`` reports them;
        ``layer_messages``: layer messages moved per group, ``"pair <p>-<d>"``), its pool
        (blocks, free), what its connector holds and moved. Each engine checks its invariants
        first (an error there is raised here)."""
        self._stats = {}
        for rank in self.alive():
            self._conns[rank].send(("stats",))
        deadline = time.monotonic() + self.timeout_s
        while not set(self.alive()) <= set(self._stats):
            if time.monotonic() > deadline:
                late = sorted(set(self.alive()) - set(self._stats))
                raise TimeoutError(f"{[self._where(r) for r in late]} did not answer")
            self._pump(0.05)
        return {r: self._stats[r] for r in self.alive()}

    def settle(self, timeout_s: float = 10.0) -> dict[int, dict[str, Any]]:
        """Wait until no live engine holds blocks for a transfer or has work; their stats."""
        end = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            if all(s["num_delayed_frees"] == 0 and s["num_unfinished"] == 0
                   for s in stats.values()) or time.monotonic() > end:
                return stats
            time.sleep(0.05)

    def timeline(self, request_id: int) -> list[Hop]:
        """The request's path across the processes, in time order."""
        return sorted(self.routes[request_id].hops, key=lambda h: h.t)

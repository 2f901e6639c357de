"""Fault injection for recovery by recompute: every method an engine step runs through is a
fault site, each faulted once per run beside a clean run of the same workload, and every
recovery the engine makes is checked as it happens.

Used by ``tests/test_fault_sites.py`` (a sample, and the proofs that the checks trip) and by
``bench/chaos.py`` (the whole sweep, per design).

* **Sites** (:func:`enumerate_sites`): every function a step can call, found by walking the
  modules of :data:`SOURCES`, never listed by hand: each module's own functions, and each of
  its classes' methods, static and class methods and properties (getters), along the class's
  MRO within ``course_lib``. A site is ``(owner, name)``, its owner the class that defines it
  (an inherited method is one site, the base's) or the module; ``kind`` says which part of the
  engine it is (:data:`KINDS`: the managers, pools, prefix cache, radix tree, schedulers,
  output processing, the engine's step, the recovery, the runner and its kernels, the
  sampler, the metrics, the requests, the KV connectors).
* **Faults** (:class:`Injector`): a site is wrapped where every caller finds it: on the class,
  or, for a function, in every ``course_lib`` module that bound it by name (``from .sampler
  import sample`` binds ``llm_engine.sample``: patched there too). Only calls made *during*
  ``LLMEngine.step``, on the thread running it, count; the k-th of them raises
  ``InjectedFault`` (a ``RuntimeError``, as a transient device error would) once.
* **Designs** (:data:`DESIGNS`): V0 recompute, V0 swap, V1 with the hash prefix cache, V1 with
  SGLang's radix tree, V1 with the CPU offload tier, and the P/D connector in one process (a
  prefill engine and a decode engine whose ``P2PConnector`` s talk through :class:`Hub`, an
  in-process stand-in for ``torch.distributed``, as ``tests/test_p2p_connector.py`` builds
  them). Prefix caching on, a pool small enough to preempt, the :func:`workload` (shared
  prefixes, n > 1, beams on V0, top-k logprobs, a salted tenant, a stop token, arrivals over
  steps).
* **Recoveries, checked as they happen** (:class:`RecoveryWatch`): around every
  ``LLMEngine._recover_now`` that returns, against what the harness itself saw when the step
  began (never the engine's own records): every request not finished by the recovery is back
  to those tokens, logprobs and sequences (a fork made by the failed step dropped), waiting
  with nothing computed, queued once in arrival order; the KV bookkeeping is empty (no table,
  every block free, nothing cached, the CPU tier empty); and the new scheduler shares no
  mutable object with the one it replaces (a pool, a table, a queue kept from the failed
  step). It counts the tokens to be recomputed itself and times each recovery.
* **Runs** (:func:`run`): ``check_invariants()`` after every step; ``StepFailed`` and
  ``RecoveryFailed`` retried; any other exception out of ``step()`` is a break. At the end:
  every request answered exactly once, no block held (every GPU block free or cached-free, the
  swap space empty, the CPU tier consistent, no transfer under way), the engine's maps empty,
  and the metrics ``course:engine_recoveries_total`` / ``course:recomputed_tokens_total``
  equal to what the watch counted. A run that does not finish in a bounded number of steps,
  or whose steps keep raising, is wedged.
* **The bar** (:func:`compare`): each request not blamed (``finish_reason != "error"``) gives
  the clean run's tokens exactly, its cumulative and top-k logprobs within 1e-4 (a recomputed
  prefill and an incremental decode round differently) and the same finish reasons; a fault
  may blame at most one request.
* **Second faults** (:func:`recovery_path`, :func:`second_fault_run`): a first fault (a
  forward that fails once: nobody to blame, ``StepFailed``; or a request whose sampling always
  fails: it is blamed), then one more fault at each site that handling it calls (the blame,
  the recovery, the new scheduler and manager being built, the connector's reset, the
  metrics), at its first call after the first fault.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import importlib
import inspect
import queue
import statistics
import sys
import threading
import time
import types
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, is_dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from course_lib.config import CacheConfig, SchedulerConfig  # noqa: E402
from course_lib.engine.llm_engine import LLMEngine  # noqa: E402
from course_lib.engine.recovery import RecoveryFailed, StepFailed  # noqa: E402
from course_lib.model.tokenizer import ByteTokenizer  # noqa: E402
from course_lib.scheduler.kv_connector import KVConnectorScheduler  # noqa: E402
from course_lib.sequence import Request, SamplingParams, Sequence  # noqa: E402

# ------------------------------------------------------------------------------ sites
# (kind, module): the module's functions and every class it defines
SOURCES: list[tuple[str, str]] = [
    ("manager", "course_lib.memory.common"),
    ("manager", "course_lib.memory.v1_interface"),
    ("manager", "course_lib.memory.v0.manager"),
    ("manager", "course_lib.memory.v0.fast"),
    ("manager", "course_lib.memory.v0.block_table"),
    ("manager", "course_lib.memory.v1.kv_cache_manager"),
    ("manager", "course_lib.memory.radix.kv_cache_manager"),
    ("pool", "course_lib.memory.v0.pool"),
    ("pool", "course_lib.memory.v1.block_pool"),
    ("pool", "course_lib.memory.radix.allocator"),
    ("prefix cache", "course_lib.memory.v0.prefix_cache"),
    ("radix tree", "course_lib.memory.radix.radix_cache"),
    ("scheduler", "course_lib.scheduler.scheduler"),
    ("scheduler", "course_lib.scheduler.v1"),
    ("scheduler", "course_lib.scheduler.admission"),
    ("scheduler", "course_lib.scheduler.policy"),
    ("scheduler", "course_lib.scheduler.output"),
    ("output processing", "course_lib.scheduler.output_processor"),
    ("output processing", "course_lib.engine.outputs"),
    ("engine step", "course_lib.engine.llm_engine"),
    ("recovery", "course_lib.engine.recovery"),
    ("runner", "course_lib.engine.model_runner"),
    ("runner", "course_lib.kernels.cache_ops"),
    ("runner", "course_lib.kernels.reference"),      # the CPU backend's cache writes,
    ("runner", "course_lib.kernels.batched"),        # copies and attention
    ("sampler", "course_lib.engine.sampler"),
    ("sampler", "course_lib.engine.logprobs"),
    ("metrics", "course_lib.scheduler.metrics"),
    ("request", "course_lib.sequence"),
    ("connector", "course_lib.scheduler.kv_connector"),
    ("connector", "course_lib.engine.kv_connector"),
    ("connector", "course_lib.engine.cpu_offload"),
    ("connector", "course_lib.engine.p2p_connector"),
    ("connector", "course_lib.engine.p2p_transport"),   # if the transport lives apart
]
KINDS = ("manager", "pool", "prefix cache", "radix tree", "scheduler", "output processing",
         "engine step", "recovery", "runner", "sampler", "metrics", "request", "connector")
# the entry point itself: the harness marks the step with it
SKIP = {("LLMEngine", "step")}


@dataclass(frozen=True)
class Site:
    """One fault site: ``owner`` (a class or a module) and ``name`` in its ``__dict__``."""
    kind: str
    owner: object = field(compare=False, repr=False)
    name: str
    label: str               # "BlockManager.allocate", "sampler.sample"
    what: str                # "method", "property", "staticmethod", "classmethod", "function"

    @property
    def key(self) -> str:
        return self.label


def _attr_kind(value) -> str | None:
    if isinstance(value, property):
        return "property" if value.fget is not None else None
    if isinstance(value, staticmethod):
        return "staticmethod"
    if isinstance(value, classmethod):
        return "classmethod"
    if inspect.isfunction(value):
        return "method"
    return None


def _modules() -> list[tuple[str, types.ModuleType]]:
    out = []
    for kind, name in SOURCES:
        try:
            out.append((kind, importlib.import_module(name)))
        except ModuleNotFoundError as exc:        # an optional module (the P2P transport)
            if exc.name != name:
                raise
    return out


def enumerate_sites() -> list[Site]:
    """Every site of :data:`SOURCES`, once (an inherited method belongs to its defining
    class, with the kind of the first module that reached it), in a stable order."""
    sites: dict[tuple[int, str], Site] = {}
    for kind, mod in _modules():
        modname, short = mod.__name__, mod.__name__.rsplit(".", 1)[-1]
        for name, value in vars(mod).items():
            if inspect.isfunction(value) and value.__module__ == modname \
                    and (id(mod), name) not in sites:
                sites[id(mod), name] = Site(kind, mod, name, f"{short}.{name}", "function")
        classes = [v for v in vars(mod).values() if inspect.isclass(v) and v.__module__ == modname]
        for cls in classes:
            for owner in cls.__mro__:
                if not owner.__module__.startswith("course_lib"):
                    continue              # object, Enum, Exception, ABC: not the course's
                for name, value in vars(owner).items():
                    what = _attr_kind(value)
                    if what is None or (owner.__name__, name) in SKIP \
                            or (id(owner), name) in sites:
                        continue
                    sites[id(owner), name] = Site(kind, owner, name,
                                                  f"{owner.__name__}.{name}", what)
    return sorted(sites.values(), key=lambda s: (KINDS.index(s.kind), s.label))


# ---------------------------------------------------------------------------- faults
_BINDINGS: dict[int, list] = {}
_INDEXED: set[str] = set()


def _bindings() -> dict[int, list]:
    """Where each function is bound in ``course_lib``: ``id(fn) -> [(how, holder, where)]``:
    a module attribute (``from .sampler import sample`` is one), a default argument
    (``victim_policy=last_arrived_first``) or a module-level table's entry
    (``HASH_FUNCTIONS["builtin"]``). Built once, and again for modules imported since."""
    names = {n for n, m in sys.modules.items() if n.startswith("course_lib") and m is not None}
    if names - _INDEXED:
        _BINDINGS.clear()
        for n in names:
            mod = sys.modules[n]
            for name, value in list(vars(mod).items()):
                if inspect.isfunction(value):
                    _BINDINGS.setdefault(id(value), []).append(("module", mod, name))
                elif isinstance(value, dict):
                    for key, v in list(value.items()):
                        if inspect.isfunction(v):
                            _BINDINGS.setdefault(id(v), []).append(("item", value, key))
            funcs = [v for v in vars(mod).values() if inspect.isfunction(v)]
            for cls in (v for v in vars(mod).values() if inspect.isclass(v)
                        and v.__module__ == n):
                funcs += [v for v in vars(cls).values() if inspect.isfunction(v)]
            for f in funcs:
                for i, d in enumerate(f.__defaults__ or ()):
                    if inspect.isfunction(d):
                        _BINDINGS.setdefault(id(d), []).append(("default", f, i))
        _INDEXED.clear()
        _INDEXED.update(names)
    return _BINDINGS


class InjectedFault(RuntimeError):
    """What an armed site raises (a ``RuntimeError``, as a transient device error would)."""


class _Patches:
    """Attributes set for a while and put back in reverse order."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def set(self, owner, name, value) -> None:
        old = vars(owner)[name] if isinstance(owner, type) else getattr(owner, name)
        setattr(owner, name, value)
        self._undo.append(lambda: setattr(owner, name, old))

    def set_item(self, table: dict, key, value) -> None:
        old = table[key]
        table[key] = value
        self._undo.append(lambda: table.__setitem__(key, old))

    def set_default(self, fn, index, value) -> None:
        old = fn.__defaults__
        fn.__defaults__ = old[:index] + (value,) + old[index + 1:]
        self._undo.append(lambda: setattr(fn, "__defaults__", old))

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()


class Injector:
    """Wraps ``sites`` (a context manager): counts their calls during steps (``calls``) and
    raises once at each armed ``(site label, k)`` of ``plan`` (``fired`` records
    ``(label, k, step attempt)``). ``hooks[label]`` are called with the call's arguments
    before it runs (a hook may raise: a request whose work fails). ``at_fire``: the calls
    when the first fault fired (or a hook first raised); ``after_fire``: those when the step
    it fired in ended (what handling the failure called lies in between). ``paused``: the
    harness's own calls inside a step (its checks) are not counted."""

    def __init__(self, sites: Iterable[Site], plan: Iterable[tuple[str, int]] = (),
                 hooks: dict[str, Callable] | None = None) -> None:
        self.sites = list(sites)
        self.plan = set(plan)
        self.hooks = hooks or {}
        self.calls: Counter = Counter()
        self.fired: list[tuple[str, int, int]] = []
        self.step_thread: int | None = None
        self.steps = 0                              # step() calls entered
        self.paused = False
        self.at_fire: Counter | None = None
        self.after_fire: Counter | None = None
        self._patches = _Patches()

    def _counts(self) -> bool:
        return self.step_thread == threading.get_ident() and not self.paused

    def _wrap(self, site: Site, fn: Callable) -> Callable:
        inj, key = self, site.key

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if inj._counts():
                n = inj.calls[key] = inj.calls[key] + 1
                if (key, n) in inj.plan:
                    inj.plan.discard((key, n))
                    inj.fired.append((key, n, inj.steps))
                    if inj.at_fire is None:
                        inj.at_fire = Counter(inj.calls)
                    raise InjectedFault(f"injected at {key} call {n}")
                hook = inj.hooks.get(key)
                if hook is not None:
                    try:
                        hook(*args, **kwargs)
                    except Exception:
                        if inj.at_fire is None:
                            inj.at_fire = Counter(inj.calls)
                        raise
            return fn(*args, **kwargs)
        wrapper.__fault_site__ = key
        return wrapper

    def __enter__(self) -> Injector:
        try:
            self._install()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _install(self) -> None:
        inj, patch = self, self._patches
        real_step = vars(LLMEngine)["step"]

        @functools.wraps(real_step)
        def step(engine, *args, **kwargs):
            outer = inj.step_thread is None
            if outer:
                inj.step_thread = threading.get_ident()
                inj.steps += 1
            try:
                return real_step(engine, *args, **kwargs)
            finally:
                if outer:
                    inj.step_thread = None
                    if inj.at_fire is not None and inj.after_fire is None:
                        inj.after_fire = Counter(inj.calls)
        patch.set(LLMEngine, "step", step)
        for site in self.sites:
            if site.what == "function":
                fn = getattr(site.owner, site.name)
                wrapped = self._wrap(site, fn)
                for how, holder, where in _bindings().get(id(fn), ()):
                    if how == "default":
                        if holder.__defaults__[where] is fn:
                            patch.set_default(holder, where, wrapped)
                    elif how == "item":
                        if holder.get(where) is fn:
                            patch.set_item(holder, where, wrapped)
                    elif vars(holder).get(where) is fn:
                        patch.set(holder, where, wrapped)
                continue
            value = vars(site.owner)[site.name]
            if site.what == "property":
                new = property(self._wrap(site, value.fget), value.fset, value.fdel,
                               value.__doc__)
            elif site.what == "staticmethod":
                new = staticmethod(self._wrap(site, value.__func__))
            elif site.what == "classmethod":
                new = classmethod(self._wrap(site, value.__func__))
            else:
                new = self._wrap(site, value)
            patch.set(site.owner, site.name, new)

    def __exit__(self, *exc) -> None:
        self._patches.undo()


# --------------------------------------------------------------------------- designs
TIER_BLOCKS = 32
DESIGNS = {
    "v0 recompute": dict(design="v0", preemption_mode="recompute", num_cpu_blocks=0,
                         prefix_cache="hash"),
    "v0 swap": dict(design="v0", preemption_mode="swap", num_cpu_blocks=16,
                    prefix_cache="hash"),
    "v1 hash": dict(design="v1", preemption_mode="recompute", num_cpu_blocks=0,
                    prefix_cache="hash"),
    "v1 radix": dict(design="v1", preemption_mode="recompute", num_cpu_blocks=0,
                     prefix_cache="radix"),
    # V1 with a CPU offload tier of TIER_BLOCKS blocks (CacheConfig.kv_offloading_size)
    "v1 cpu tier": dict(design="v1", preemption_mode="recompute", num_cpu_blocks=0,
                        prefix_cache="hash", tier_blocks=TIER_BLOCKS),
    # a prefill engine and a decode engine (P2PConnector), in one process
    "p/d pair": dict(design="v1", preemption_mode="recompute", num_cpu_blocks=0,
                     prefix_cache="hash", pair=True),
}


def is_pair(design: str) -> bool:
    return bool(DESIGNS[design].get("pair"))


def _configs(model, design: str, num_gpu_blocks: int, budget: int, max_num_seqs: int,
             num_cpu_blocks: int | None) -> tuple[SchedulerConfig, CacheConfig]:
    d = DESIGNS[design]
    cpu = d["num_cpu_blocks"] if num_cpu_blocks is None or not d["num_cpu_blocks"] \
        else num_cpu_blocks
    tier = None
    if d.get("tier_blocks"):
        cfg = model.config
        block_bytes = (2 * cfg.num_layers * 4 * cfg.num_kv_heads * cfg.head_dim
                       * next(model.parameters()).element_size())
        tier = d["tier_blocks"] * block_bytes / 2**30
    sc = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                         max_model_len=model.config.max_position,
                         preemption_mode=d["preemption_mode"])
    cc = CacheConfig(block_size=4, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=cpu,
                     watermark=0.0, enable_prefix_caching=True, prefix_cache=d["prefix_cache"],
                     kv_offloading_size=tier)
    return sc, cc


def make_engine(model, design: str, *, num_gpu_blocks: int = 12, budget: int = 32,
                max_num_seqs: int = 16, num_cpu_blocks: int | None = None,
                kv_connector=None) -> LLMEngine:
    """A small engine of ``design`` (a :data:`DESIGNS` key, not the pair): blocks of 4,
    prefix caching on, a pool that preempts under :func:`workload`, a constant clock
    (timings are data too). ``num_cpu_blocks``: the swap space of a design that swaps."""
    sc, cc = _configs(model, design, num_gpu_blocks, budget, max_num_seqs, num_cpu_blocks)
    return LLMEngine(model, sc, cc, stop_token_ids=(), design=DESIGNS[design]["design"],
                     clock=lambda: 0.0, kv_connector=kv_connector)


# ------------------------------------------------------------- the P/D pair, in-process
class Hub:
    """Messages between the two ranks of one process: a queue per (src, dst, tag)."""

    def __init__(self) -> None:
        self.queues: dict[tuple[int, int, int], queue.Queue] = defaultdict(queue.Queue)
        self.lock = threading.Lock()
        self.objects: dict[int, object] = {}
        self.closed = False

    def queue(self, key: tuple[int, int, int]) -> queue.Queue:
        with self.lock:
            return self.queues[key]


class Loopback:
    """The four ``torch.distributed`` calls the P2P connector makes, for one rank of a
    :class:`Hub` (``tests/test_p2p_connector.py`` has the same stand-in)."""

    def __init__(self, hub: Hub, rank: int) -> None:
        self.hub, self.rank = hub, rank

    def get_world_size(self) -> int:
        return 2

    def all_gather_object(self, out: list, obj: object) -> None:
        self.hub.objects[self.rank] = obj
        out[:] = [self.hub.objects[r] for r in range(2)]

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0, group: object = None) -> None:
        self.hub.queue((self.rank, dst, tag)).put(tensor.clone())

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0, group: object = None) -> None:
        q = self.hub.queue((src, self.rank, tag))
        for _ in range(400):                  # 20 s, in steps that notice a closed hub
            if self.hub.closed:
                raise ConnectionError("the hub is closed")
            try:
                tensor.copy_(q.get(timeout=0.05))
                return
            except queue.Empty:
                continue
        raise TimeoutError(f"no message from rank {src} with tag {tag} in 20 s")


ROLES = {0: "kv_producer", 1: "kv_consumer"}


def make_pair(model, design: str = "p/d pair", **kwargs) -> tuple[LLMEngine, LLMEngine, Hub]:
    """A prefill engine (rank 0) and a decode engine (rank 1) of ``design``'s configuration,
    connected through one :class:`Hub`; :func:`close_pair` stops their threads."""
    from course_lib.engine.p2p_connector import KVLayout, P2PConnector
    from course_lib.engine.p2p_transport import P2PTransport

    hub = Hub()
    engines = [make_engine(model, design, kv_connector=P2PConnector(
        ROLES[r], P2PTransport(r, comm=Loopback(hub, r))), **kwargs) for r in (0, 1)]
    for r, e in enumerate(engines):      # what every rank says in the all-gather
        hub.objects[r] = (ROLES[r], KVLayout.of(e.runner.gpu_caches))
    for e in engines:
        e.kv_connector.connect(ROLES)
    return engines[0], engines[1], hub


def close_pair(engines: Iterable[LLMEngine], hub: Hub) -> None:
    """Stop the pair's threads and wait for them (the transport names them ``kv-...``): a
    thread still inside torch when the interpreter exits aborts the process."""
    hub.closed = True
    for e in engines:
        e.kv_connector.transport.close()
    for t in threading.enumerate():
        if t.name.startswith("kv-") and t is not threading.current_thread():
            t.join(timeout=10)


# --------------------------------------------------------------------------- workload
@dataclass(frozen=True)
class Arrival:
    step: int                 # added before the step that finds engine.num_steps == step
    prompt: list[int]
    params: SamplingParams
    cache_salt: str | None = None


def workload(design: str, max_tokens: int = 4) -> list[Arrival]:
    """Seven requests over four steps: shared prefixes (one salted apart), greedy and seeded
    n = 2-3, a beam search of width 2 (V0; V1 runs no beams, it gets a seeded n = 2), top-k
    logprobs, a stop token. Every request has a seed (the engine draws one at random for a
    request without, which would differ between two runs). The P/D pair runs one sample per
    request (its prefill engine samples the first token alone)."""
    tok, mt = ByteTokenizer(), max_tokens
    shared = "In the beginning God created "
    space = tok.encode(" ", add_bos=False)[0]
    v0, pair = DESIGNS[design]["design"] == "v0", is_pair(design)

    def n(k: int, **kw) -> SamplingParams:
        return SamplingParams(max_tokens=mt, n=1 if pair else k, **kw)
    beams = SamplingParams(max_tokens=mt, beam_width=2, seed=5) if v0 \
        else n(2, temperature=0.9, seed=11)
    rows = [
        (0, shared + "the heaven", n(1, temperature=0.0, logprobs=2, seed=1), None),
        (0, shared + "the earth", n(2, temperature=0.8, seed=3), None),
        (1, "And God said, Let there", SamplingParams(max_tokens=mt + 2, temperature=0.0,
                                                      stop_token_ids=[space], seed=4), None),
        (1, shared + "light", beams, None),
        (2, "Jesus wept. And the", n(3, temperature=0.7, seed=6, logprobs=1), None),
        (2, shared + "the heaven", n(2, temperature=0.0, seed=8), "tenant-b"),
        (3, shared + "the heaven and", n(1, temperature=0.9, seed=7), None),
    ]
    return [Arrival(s, tok.encode(p), sp, salt) for s, p, sp, salt in rows]


# ------------------------------------------------------------- what a recovery must leave
def _request_state(req: Request) -> tuple:
    """A request as the harness sees it when a step begins: (its sequences, and per sequence
    its status, output tokens, top-k count, cumulative logprob, computed tokens and KV
    connector parameters)."""
    return (list(req.seqs),
            [(s.status, list(s.output_token_ids), len(s.output_logprobs), s.cumulative_logprob,
              s.num_computed_tokens, s.kv_transfer_params) for s in req.seqs])


def _unfinished(engine: LLMEngine) -> list[Request]:
    """The engine's unfinished requests, in arrival order (the order a recovery queues)."""
    reqs = [r for r in engine._requests.values() if not r.is_finished]
    return sorted(reqs, key=lambda r: (r.arrival_time, r.request_id))


_LEAVES = (int, float, complex, str, bytes, bool, type(None), range, enum.Enum, type,
           types.FunctionType, types.BuiltinFunctionType, types.ModuleType, torch.Tensor)
# shared on purpose by the old scheduler and the new: the requests (recomputed), the configs,
# the KV connector (reset, not rebuilt: it owns the tier's tensors and the transport)
_SHARED = (Request, Sequence, SamplingParams, SchedulerConfig, CacheConfig, KVConnectorScheduler)


def mutable_parts(root) -> dict[int, tuple[object, str]]:
    """Every mutable object reachable from ``root`` (through attributes, slots, containers and
    bound methods), the shared-on-purpose ones (:data:`_SHARED`) and what they hold left out:
    ``{id: (object, a path to it)}``. Containers (list, dict, set, deque) and instances of the
    course's classes count; tuples, frozen dataclasses and plain values do not (they are
    walked through)."""
    out: dict[int, tuple[object, str]] = {}
    seen: set[int] = set()
    stack = [(root, type(root).__name__)]
    while stack:
        obj, path = stack.pop()
        if id(obj) in seen or isinstance(obj, _LEAVES) or isinstance(obj, _SHARED):
            continue
        seen.add(id(obj))
        if isinstance(obj, types.MethodType):
            stack.append((obj.__self__, path + ".__self__"))
            continue
        if isinstance(obj, dict):
            out[id(obj)] = (obj, path)
            stack += [(k, f"{path}[key]") for k in obj]
            stack += [(v, f"{path}[{k!r:.20}]") for k, v in obj.items()]
            continue
        if isinstance(obj, list | set | bytearray | deque):
            out[id(obj)] = (obj, path)
            stack += [(v, f"{path}[{i}]") for i, v in enumerate(obj)]
            continue
        if isinstance(obj, tuple | frozenset):
            stack += [(v, f"{path}[{i}]") for i, v in enumerate(obj)]
            continue
        if not type(obj).__module__.startswith("course_lib"):
            continue                              # a lock, a tensor's storage: not state
        frozen = is_dataclass(obj) and type(obj).__dataclass_params__.frozen
        if not frozen:
            out[id(obj)] = (obj, path)
        fields = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
        for cls in type(obj).__mro__:
            for name in getattr(cls, "__slots__", ()):
                if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                    fields[name] = getattr(obj, name)
        stack += [(v, f"{path}.{k}") for k, v in fields.items()]
    return out


def kv_bookkeeping_left(engine: LLMEngine) -> list[str]:
    """What the engine's KV bookkeeping still holds: tables, held or cached blocks (GPU, and
    the V0 swap space), the V1 manager's delayed frees, the CPU tier's blocks. Empty right
    after a recovery (everything was rebuilt empty)."""
    bm, left = engine.block_manager, []
    if bm.seq_ids():
        left.append(f"tables of sequences {bm.seq_ids()}")
    for device in ("gpu", "cpu") if engine.design == "v0" else ("gpu",):
        u = bm.usage(device)
        if u.num_free_blocks != u.num_total_blocks or u.num_cached_free_blocks:
            left.append(f"{u.num_total_blocks - u.num_free_blocks} {device} blocks held, "
                        f"{u.num_cached_free_blocks} cached")
    if getattr(bm, "delayed_frees", None):
        left.append(f"delayed frees of {sorted(bm.delayed_frees)}")
    pool = getattr(engine.kv_connector, "cpu_pool", None)
    if pool is not None and pool.lru_hashes():
        left.append(f"{len(pool.lru_hashes())} CPU-tier blocks")
    return left


def _queued(scheduler) -> tuple[list, list]:
    """(what the scheduler's waiting queue holds, what its other queues hold)."""
    others = [*scheduler.running, *getattr(scheduler, "swapped", ()),
              *getattr(scheduler, "waiting_for_remote", ())]
    return list(scheduler.waiting), others


# problems a run can show
WRONG_TOKENS = "wrong tokens"
WRONG_LOGPROBS = "wrong logprobs"
WRONG_OUTPUT = "output differs"          # finish reasons, number of completions
KEPT_STATE = "recovery kept old state"   # the new scheduler shares an object with the old
NOT_EMPTY = "recovery left KV bookkeeping"
NOT_RESTORED = "request not restored"    # not back to what it had when the step began
NOT_QUEUED = "request not requeued"
INVARIANT = "invariant broken"
RAISED = "raised"                        # step() raised something but StepFailed/RecoveryFailed
WEDGED = "wedged"
LEAKED = "leaked blocks"
MAPS = "engine maps kept"
LOST = "request lost"
DUPLICATE = "answered twice"
COUNTERS = "metrics disagree"
BLAME = "wrong blame"
NOT_FIRED = "not fired"
CATEGORIES = (WRONG_TOKENS, WRONG_LOGPROBS, WRONG_OUTPUT, KEPT_STATE, NOT_EMPTY, NOT_RESTORED,
              NOT_QUEUED, INVARIANT, RAISED, WEDGED, LEAKED, MAPS, LOST, DUPLICATE, COUNTERS,
              BLAME, NOT_FIRED)
MISMATCHES = (WRONG_TOKENS, WRONG_LOGPROBS, WRONG_OUTPUT, LOST, DUPLICATE)


class RecoveryWatch:
    """Checks every recovery as it happens (a context manager, over every engine).

    At each ``step()`` it keeps what each unfinished request has (:func:`_request_state`):
    the committed state, unless the engine has a recovery due (after ``RecoveryFailed``: the
    requests may be half restored; what was committed is what the watch kept before). After
    each ``_recover_now`` that returns, it checks (module docstring): the requests, the new
    scheduler's queues, the empty KV bookkeeping, nothing shared with the old scheduler.
    ``problems``, ``recoveries``, ``recovery_ms``, ``recomputed_tokens`` (the tokens whose K/V
    the restored requests had: counted here, from what the harness saw). ``injector``:
    paused while the watch reads the engine (its reads are not the step's)."""

    def __init__(self, injector: Injector | None = None) -> None:
        self.injector = injector
        self.problems: list[tuple[str, str]] = []
        self.recoveries = 0
        self.recovery_ms: list[float] = []
        self.recomputed_tokens = 0
        self.unchecked = 0                   # recoveries made outside a step
        self._committed: dict[int, dict[int, tuple[Request, tuple]]] = {}
        self._stepping: set[int] = set()
        self._patches = _Patches()

    def __enter__(self) -> RecoveryWatch:
        watch, real_step = self, vars(LLMEngine)["step"]
        real_recover = vars(LLMEngine)["_recover_now"]

        @functools.wraps(real_step)
        def step(engine, *args, **kwargs):
            key = id(engine)
            if engine._recovery is None:       # else it still has the last committed state
                watch._committed[key] = {r.request_id: (r, _request_state(r))
                                         for r in _unfinished(engine)}
            watch._stepping.add(key)
            try:
                return real_step(engine, *args, **kwargs)
            finally:
                watch._stepping.discard(key)

        @functools.wraps(real_recover)
        def recover_now(engine, *args, **kwargs):
            old = engine.scheduler
            t0 = time.perf_counter()
            real_recover(engine, *args, **kwargs)
            watch.recovery_ms.append(1e3 * (time.perf_counter() - t0))
            watch.recoveries += 1
            inj = watch.injector
            paused = inj is not None and inj.paused
            if inj is not None:
                inj.paused = True
            try:
                watch._check(engine, old)
            finally:
                if inj is not None:
                    inj.paused = paused

        self._patches.set(LLMEngine, "step", step)
        self._patches.set(LLMEngine, "_recover_now", recover_now)
        return self

    def __exit__(self, *exc) -> None:
        self._patches.undo()

    def _problem(self, cat: str, detail: str) -> None:
        self.problems.append((cat, f"recovery {self.recoveries}: {detail}"))

    def _check(self, engine: LLMEngine, old) -> None:
        new = engine.scheduler
        if new is old:
            self._problem(KEPT_STATE, "the scheduler was not rebuilt")
        else:
            theirs = mutable_parts(old)
            shared = [path for i, (_, path) in mutable_parts(new).items() if i in theirs]
            if shared:
                self._problem(KEPT_STATE, f"{len(shared)} objects of the failed step's "
                                          f"scheduler kept, e.g. {', '.join(sorted(shared)[:3])}")
        left = kv_bookkeeping_left(engine)
        if left:
            self._problem(NOT_EMPTY, "; ".join(left))
        waiting, others = _queued(new)
        expected = _unfinished(engine)
        if engine.design == "v0":
            want = [r.request_id for r in expected]
            got = [r.request_id for r in waiting]
        else:
            want = [s.seq_id for r in expected for s in r.unfinished_seqs]
            got = [s.seq_id for s in waiting]
        if got != want or others:
            self._problem(NOT_QUEUED, f"waiting {got} (want {want}), others "
                                      f"{[getattr(x, 'seq_id', x) for x in others]}")
        if id(engine) not in self._stepping:
            self.unchecked += 1                # nothing seen before it: requests not checked
            return
        for rid, (req, (seqs, states)) in self._committed[id(engine)].items():
            if not (req.is_finished and req.finish_reason in ("error", "abort")):
                self.recomputed_tokens += sum(st[4] for st in states if not st[0].is_finished)
            bad = self._restored(req, seqs, states)
            if bad:
                self._problem(NOT_RESTORED, f"request {rid}: {bad}")

    def _restored(self, req: Request, seqs: list, states: list) -> str | None:
        """What differs between ``req`` now and what it had when the step began (``seqs``,
        ``states``), each unfinished sequence preempted by recompute; None if nothing. A
        request the recovery finished (blamed, or aborted) keeps its outputs as they were."""
        ended = req.is_finished and req.finish_reason in ("error", "abort")
        if req.is_finished and not ended:
            return f"finished ({req.finish_reason}) by a failed step"
        if list(req.seqs) != seqs or any(a is not b for a, b in zip(req.seqs, seqs, strict=True)):
            return f"sequences {[s.seq_id for s in req.seqs]}, had {[s.seq_id for s in seqs]}"
        for s, (status, out, n_top, cum, _, params) in zip(seqs, states, strict=True):
            if list(s.output_token_ids) != out or len(s.output_logprobs) != n_top \
                    or s.cumulative_logprob != cum:
                return f"sequence {s.seq_id} has {len(s.output_token_ids)} tokens, " \
                    f"{len(s.output_logprobs)} top-k, logprob {s.cumulative_logprob:.4f}; " \
                    f"had {len(out)}, {n_top}, {cum:.4f}"
            if s.kv_transfer_params != params:
                return f"sequence {s.seq_id}'s kv_transfer_params {s.kv_transfer_params} " \
                    f"(had {params})"
            if ended:
                continue
            if status.is_finished:
                if s.status != status:
                    return f"finished sequence {s.seq_id} is {s.status.name}"
            elif s.status.name != "WAITING" or s.num_computed_tokens:
                return f"sequence {s.seq_id} is {s.status.name} with {s.num_computed_tokens} " \
                    "computed tokens (want WAITING, 0)"
        return None


def metric_total(engine: LLMEngine, name: str) -> float:
    """A counter of the engine's metrics, summed over its labels (0 if absent)."""
    return sum(s.value for f in engine.metrics.registry.collect() for s in f.samples
               if s.name == name)


def leaks(engine: LLMEngine) -> list[str]:
    """What a finished run may not hold: tables, blocks held (every GPU block must be free or
    cached-free; the swap space empty), delayed frees, a CPU tier that fails its invariants,
    a connector with transfers under way."""
    bm, out = engine.block_manager, []
    if bm.seq_ids():
        out.append(f"tables of {bm.seq_ids()}")
    for device in ("gpu", "cpu") if engine.design == "v0" else ("gpu",):
        u = bm.usage(device)
        if u.num_free_blocks != u.num_total_blocks:
            out.append(f"{u.num_total_blocks - u.num_free_blocks} {device} blocks held")
    if getattr(bm, "delayed_frees", None):
        out.append(f"delayed frees of {sorted(bm.delayed_frees)}")
    conn = engine.kv_connector
    if conn is not None:
        try:
            conn.check_invariants()
        except AssertionError as exc:
            out.append(f"connector: {exc}")
        if getattr(conn, "busy", lambda: False)():
            out.append("connector still busy")
    return out


# ------------------------------------------------------------------------------- runs
@dataclass
class RunResult:
    design: str
    outputs: dict = field(default_factory=dict)      # request_id -> its final RequestOutput
    steps: int = 0                                   # step() calls
    step_failed: int = 0                             # StepFailed raised (recovered)
    recovery_failed: int = 0                         # RecoveryFailed raised
    recoveries: int = 0                              # recoveries made (seen by the watch)
    recovery_ms: list[float] = field(default_factory=list)
    recomputed_tokens: int = 0                       # counted by the watch
    metric_recomputed: float = 0.0                   # course:recomputed_tokens_total
    blamed: list[int] = field(default_factory=list)  # finished with "error"
    problems: list[tuple[str, str]] = field(default_factory=list)
    fired: list[tuple[str, int, int]] = field(default_factory=list)
    calls: Counter = field(default_factory=Counter)  # site label -> calls during steps
    leaked: int = 0                                  # leak findings at the end

    def categories(self) -> set[str]:
        return {c for c, _ in self.problems}


def run(model, design: str, work: list[Arrival] | None = None, *,
        injector: Injector | None = None, max_steps: int = 200, max_raises: int = 4,
        between: Callable[[LLMEngine, int], None] | None = None,
        engine_kwargs: dict | None = None) -> RunResult:
    """Run ``work`` (default :func:`workload`) through a fresh engine of ``design`` (or the
    P/D pair), with ``injector`` installed (before the engine is built, so that bound methods
    kept at construction are the wrapped ones) and every recovery watched. Arrivals are keyed
    on ``engine.num_steps`` (the prefill engine's, for the pair; a failed step does not
    advance it), so a faulty run sees the clean run's arrivals at the same points.
    ``between(engine, attempt)`` runs before each step. Stops at the first broken invariant,
    after ``max_raises`` steps in a row that raise anything but ``StepFailed`` (wedged), or
    after ``max_steps`` step() calls (wedged). ``engine_kwargs`` go to :func:`make_engine`."""
    work = workload(design) if work is None else work
    res = RunResult(design)
    watch = RecoveryWatch(injector)
    driver = _run_pair if is_pair(design) else _run_one
    with injector if injector is not None else contextlib.nullcontext(), watch:
        driver(model, design, work, res, max_steps, max_raises, between, engine_kwargs or {},
               watch)
    if injector is not None:
        res.fired, res.calls = list(injector.fired), Counter(injector.calls)
    res.problems += watch.problems
    res.recovery_ms, res.recomputed_tokens = watch.recovery_ms, watch.recomputed_tokens
    res.recoveries = watch.recoveries
    lost = sorted(set(range(len(work))) - res.outputs.keys())
    if lost:
        res.problems.append((LOST, f"requests {lost} never answered"))
    return res


class _Stepper:
    """One engine's steps in a run: each ``step()`` counted and checked, its outputs
    collected; ``dead`` once the run must stop (a broken invariant, wedged)."""

    def __init__(self, engine: LLMEngine, res: RunResult, name: str, max_raises: int) -> None:
        self.engine, self.res, self.name, self.max_raises = engine, res, name, max_raises
        self.raises = 0
        self.answered: set[int] = set()
        self.dead = False

    def step(self) -> list:
        res, engine = self.res, self.engine
        res.steps += 1
        got, due = [], False
        try:
            got = engine.step()
            self.raises = 0
        except StepFailed:
            res.step_failed += 1
            self.raises = 0
        except RecoveryFailed:               # a recovery due: the next step() runs it first
            res.recovery_failed += 1
            self.raises += 1
            due = True
        except Exception as exc:             # noqa: BLE001 - the harness reports it
            res.problems.append((RAISED, f"{self.name}step {res.steps}: "
                                         f"{type(exc).__name__}: {exc}"))
            self.raises += 1
        if self.raises >= self.max_raises:
            res.problems.append((WEDGED, f"{self.name}{self.raises} steps in a row raised"))
            self.dead = True
            return []
        try:
            if not due:                      # (half restored until then)
                engine.check_invariants()
        except Exception as exc:              # noqa: BLE001
            res.problems.append((INVARIANT, f"{self.name}after step {res.steps}: "
                                            f"{type(exc).__name__}: {exc}"))
            self.dead = True
            return []
        for o in got:
            if o.request_id in self.answered:
                res.problems.append((DUPLICATE, f"{self.name}request {o.request_id}"))
            self.answered.add(o.request_id)
        return got

    def finish(self, watch: RecoveryWatch) -> None:
        """The end-of-run checks of this engine."""
        res, engine = self.res, self.engine
        found = leaks(engine)
        res.leaked += len(found)
        if found:
            res.problems.append((LEAKED, f"{self.name}{'; '.join(found)}"))
        maps = {k: sorted(getattr(engine, k)) for k in ("_requests", "_seeds", "_records")
                if getattr(engine, k, None)}
        if maps:
            res.problems.append((MAPS, f"{self.name}{maps}"))
        recoveries = metric_total(engine, "course:engine_recoveries_total")
        recomputed = metric_total(engine, "course:recomputed_tokens_total")
        res.metric_recomputed += recomputed
        if recoveries != engine.num_recoveries:
            res.problems.append((COUNTERS, f"{self.name}course:engine_recoveries_total "
                                           f"{recoveries}, recoveries {engine.num_recoveries}"))


def _check_recomputed(res: RunResult, watch: RecoveryWatch) -> None:
    """``course:recomputed_tokens_total`` against the watch's own count (when it saw every
    recovery from inside a step)."""
    if not watch.unchecked and res.metric_recomputed != watch.recomputed_tokens:
        res.problems.append((COUNTERS, f"course:recomputed_tokens_total "
                                       f"{res.metric_recomputed:g}, counted "
                                       f"{watch.recomputed_tokens}"))


def _add(engine: LLMEngine, rid: int, a: Arrival, **kwargs) -> None:
    engine.add_request(a.prompt, a.params, request_id=rid, arrival_time=float(a.step),
                       cache_salt=a.cache_salt, **kwargs)


def _run_one(model, design, work, res, max_steps, max_raises, between, engine_kwargs, watch):
    engine = make_engine(model, design, **engine_kwargs)
    stepper = _Stepper(engine, res, "", max_raises)
    added = 0
    while True:
        while added < len(work) and work[added].step <= engine.num_steps:
            _add(engine, added, work[added])
            added += 1
        if added == len(work) and not engine.has_unfinished_requests():
            break
        if res.steps >= max_steps:
            res.problems.append((WEDGED, f"not finished after {max_steps} steps"))
            return
        if between is not None:
            between(engine, res.steps)
        for o in stepper.step():
            res.outputs[o.request_id] = o
            if o.finish_reason == "error":
                res.blamed.append(o.request_id)
        if stepper.dead:
            return
    stepper.finish(watch)
    _check_recomputed(res, watch)


def _run_pair(model, design, work, res, max_steps, max_raises, between, engine_kwargs, watch):
    """The proxy and both processes' loops, interleaved in one thread (as
    ``tests/test_p2p_connector.py`` drives them): each request's prefill on the prefill
    engine (``max_tokens=1``, ``do_remote_decode``), then its decode on the decode engine with
    the parameters the prefill returned. A request blamed on either engine ends there."""
    prefill, decode, hub = make_pair(model, design, **engine_kwargs)
    max_seconds = 60 + 0.05 * max_steps           # (a transfer that never ends: wedged too)
    steppers = [_Stepper(prefill, res, "prefill ", max_raises),
                _Stepper(decode, res, "decode ", max_raises)]
    try:
        added, t0 = 0, time.monotonic()
        while True:
            while added < len(work) and work[added].step <= prefill.num_steps:
                a = work[added]
                _add(prefill, added, replace(a, params=replace(a.params, max_tokens=1)),
                     kv_transfer_params={"do_remote_decode": True})
                added += 1
            if added == len(work) and not any(
                    e.has_unfinished_requests() or e.kv_connector.busy()
                    for e in (prefill, decode)):
                break
            if res.steps >= max_steps or time.monotonic() - t0 > max_seconds:
                res.problems.append((WEDGED, f"not finished after {res.steps} steps"))
                return
            idle = not any(e.has_unfinished_requests() or e.kv_connector.busy()
                           for e in (prefill, decode))
            for s in steppers:
                e = s.engine
                e.kv_connector.serve_transfers()
                if not (e.has_unfinished_requests() or e.kv_connector.busy()
                        or idle and e is prefill):          # (arrivals keyed on its steps)
                    continue
                if between is not None:
                    between(e, res.steps)
                for o in s.step():
                    if o.finish_reason == "error":
                        res.blamed.append(o.request_id)
                        res.outputs[o.request_id] = o
                    elif e is prefill:
                        a = work[o.request_id]
                        _add(decode, o.request_id, a, kv_transfer_params=o.kv_transfer_params)
                    else:
                        res.outputs[o.request_id] = o
                if s.dead:
                    return
            time.sleep(0.0005)               # the peers' threads move the blocks
        for s in steppers:
            s.finish(watch)
        _check_recomputed(res, watch)
    finally:
        close_pair((prefill, decode), hub)


# ------------------------------------------------------------------------------ the bar
def _completions(o) -> list:
    return [(c.index, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason)
            for c in o.outputs]


def _close(a, b, tol: float) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= tol
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_close(x, y, tol) for x, y in zip(a, b, strict=True))
    return a == b


def compare(clean: RunResult, faulty: RunResult, tol: float = 1e-4, *,
            expected_blamed: Iterable[int] = ()) -> list[tuple[str, str]]:
    """What differs between ``faulty`` and ``clean`` for the requests not blamed (module
    docstring); the problems are also appended to ``faulty.problems``. Each fault may blame
    one request, besides ``expected_blamed`` (requests made to fail), which must be blamed."""
    problems = []
    expected = set(expected_blamed)
    unexpected = [r for r in faulty.blamed if r not in expected]
    if len(unexpected) > len(faulty.fired):
        problems.append((BLAME, f"{unexpected} blamed for {len(faulty.fired)} faults"))
    missed = sorted(expected - set(faulty.blamed) - set(clean.blamed))
    if missed:
        problems.append((BLAME, f"requests {missed}, whose work always fails, not blamed"))
    for rid, c in clean.outputs.items():
        f = faulty.outputs.get(rid)
        if f is None or f.finish_reason == "error" or rid in expected:
            continue
        ca, fa = _completions(c), _completions(f)
        if [x[1] for x in ca] != [x[1] for x in fa]:
            problems.append((WRONG_TOKENS, f"request {rid}: {[x[1] for x in fa]} instead of "
                                           f"{[x[1] for x in ca]}"))
        elif not _close([x[2:4] for x in ca], [x[2:4] for x in fa], tol):
            problems.append((WRONG_LOGPROBS, f"request {rid}"))
        elif [(x[0], x[4]) for x in ca] != [(x[0], x[4]) for x in fa] \
                or c.finish_reason != f.finish_reason:
            problems.append((WRONG_OUTPUT, f"request {rid}: finish reasons or indices"))
    faulty.problems += problems
    return problems


# ------------------------------------------------------------------------------ sweep
def reach(model, design: str, sites: list[Site] | None = None) -> tuple[RunResult, Counter]:
    """The clean run of ``design`` with every site counted: (the run, calls per site label
    during steps). A site with no call is never reached by this design's steps."""
    sites = enumerate_sites() if sites is None else sites
    res = run(model, design, injector=Injector(sites))
    if res.problems or res.recoveries:
        raise AssertionError(f"the clean {design} run has problems: {res.problems}")
    return res, res.calls


def pick_ks(n: int, exhaustive: bool = False) -> list[int]:
    """Which calls of a site reached ``n`` times to fault: the first and the middle one; or,
    exhaustive, every call up to 12, else the first three and every eighth of the way."""
    if n <= 0:
        return []
    if not exhaustive:
        return sorted({1, (n + 1) // 2})
    if n <= 12:
        return list(range(1, n + 1))
    return sorted({1, 2, 3, *(max(1, round(n * i / 8)) for i in range(1, 9))})


def sample_sites(sites: list[Site], calls: Counter, per_kind: int, salt: str = ""
                 ) -> list[Site]:
    """``per_kind`` reached sites of each kind, spread over the kind's sites (which ones
    turns with ``salt``, e.g. the design's name, so that designs cover different ones)."""
    out = []
    for kind in KINDS:
        reached = [s for s in sites if s.kind == kind and calls[s.key]]
        if not reached:
            continue
        start = sum(map(ord, kind + salt)) % len(reached)
        step = max(1, len(reached) // per_kind)
        out += [reached[(start + i * step) % len(reached)]
                for i in range(min(per_kind, len(reached)))]
    return list(dict.fromkeys(out))


@dataclass
class FaultRun:
    design: str
    site: Site
    k: int
    result: RunResult
    also: tuple = ()                 # the first fault of a second-fault run, described

    @property
    def problems(self) -> list[tuple[str, str]]:
        return self.result.problems


def max_steps_for(clean: RunResult) -> int:
    """A bound on a faulty run's steps: every recovery costs a few steps of recompute."""
    return 3 * clean.steps + 40


def fault_run(model, design: str, site: Site, k: int, clean: RunResult, *,
              hooks: dict | None = None, between: Callable | None = None) -> FaultRun:
    """One run of ``design`` with ``site``'s k-th call during a step failing once, compared
    with ``clean`` (:func:`reach`)."""
    res = run(model, design, injector=Injector([site], [(site.key, k)], hooks),
              max_steps=max_steps_for(clean), between=between)
    if (site.key, k) not in {(f[0], f[1]) for f in res.fired}:
        res.problems.append((NOT_FIRED, f"{site.key} call {k} never came"))
    compare(clean, res)
    return FaultRun(design, site, k, res)


# -------------------------------------------------------------------- second faults
POISONED = 0        # the request of :func:`workload` whose sampling fails from its 2nd token
FORWARD = "ModelRunner.execute_model"
FIRST_FAULTS = ("forward", "poisoned request")


def _poison(entry, logits, *args, **kwargs):
    if entry.request.request_id == POISONED and entry.seq.output_token_ids:
        raise FloatingPointError("poisoned request")


def _first_fault(first: str, sites: list[Site], calls: Counter
                 ) -> tuple[list[Site], list[tuple[str, int]], dict, list[int]]:
    """(sites to wrap, plan, hooks, requests expected blamed) of a first fault:
    ``"forward"``, the middle forward failing once (nobody to blame: ``StepFailed``), or
    ``"poisoned request"``, request :data:`POISONED`'s sampling failing from its second token
    on (it must be blamed, alone)."""
    by_key = {s.key: s for s in sites}
    if first == "forward":
        return [by_key[FORWARD]], [(FORWARD, (calls[FORWARD] + 1) // 2)], {}, []
    return [by_key["sampler.sample"]], [], {"sampler.sample": _poison}, [POISONED]


def recovery_path(model, design: str, sites: list[Site], calls: Counter, first: str
                  ) -> dict[str, int]:
    """What handling ``first`` (a :data:`FIRST_FAULTS` entry) calls, from the failure to the
    end of its step (the blame, the recovery, the new scheduler, the connector's reset, the
    metrics): ``{site label: the k of its first call after the failure}``."""
    _, plan, hooks, _ = _first_fault(first, sites, calls)
    inj = Injector(sites, plan, hooks)
    run(model, design, injector=inj, max_steps=400)
    before, after = inj.at_fire or Counter(), inj.after_fire or Counter()
    return {s: before[s] + 1 for s in after if after[s] > before[s]}


def second_fault_run(model, design: str, first: str, site: Site, k: int, clean: RunResult,
                     sites: list[Site], calls: Counter) -> FaultRun:
    """``first`` (a :data:`FIRST_FAULTS` entry), then ``site``'s k-th call failing once
    (:func:`recovery_path` gives the k of its first call after the first fault)."""
    wrap, plan, hooks, blamed = _first_fault(first, sites, calls)
    res = run(model, design, injector=Injector([*wrap, site], [*plan, (site.key, k)], hooks),
              max_steps=max_steps_for(clean))
    if (site.key, k) not in {(f[0], f[1]) for f in res.fired}:
        res.problems.append((NOT_FIRED, f"{site.key} call {k} never came"))
    compare(clean, res, expected_blamed=blamed)
    return FaultRun(design, site, k, res, (first,))


def sweep(model, designs: Iterable[str] = DESIGNS, *, exhaustive: bool = False,
          second: bool = True, sites: list[Site] | None = None,
          ks: Callable[[Site, int, str], list[int]] | None = None,
          pick_second: Callable[[dict[str, int], str], dict[str, int]] | None = None,
          progress: Callable[[str], None] | None = None) -> dict:
    """For each design: the clean run, the calls per site, one fault run per reached site and
    picked k (``ks(site, calls, design)``, default :func:`pick_ks`), and (``second``) for each
    first fault of :data:`FIRST_FAULTS` one second fault at each site its recovery path calls
    (``pick_second(path, design)`` may keep a part of the path). Returns ``{design: {"clean",
    "calls", "runs", "paths", "second", "not reached", "seconds"}}``."""
    sites = enumerate_sites() if sites is None else sites
    by_label = {s.key: s for s in sites}
    report = {}
    for design in designs:
        t0 = time.perf_counter()
        clean, calls = reach(model, design, sites)
        runs = []
        for site in sites:
            picked = ks(site, calls[site.key], design) if ks is not None \
                else pick_ks(calls[site.key], exhaustive)
            for k in picked:
                runs.append(fault_run(model, design, site, k, clean))
        paths, seconds = {}, []
        if second:
            for first in FIRST_FAULTS:
                path = recovery_path(model, design, sites, calls, first)
                paths[first] = path
                if pick_second is not None:
                    path = pick_second(path, design)
                for label, k in sorted(path.items()):
                    seconds.append(second_fault_run(model, design, first, by_label[label], k,
                                                    clean, sites, calls))
        on_path = {s for p in paths.values() for s in p}
        report[design] = {"clean": clean, "calls": calls, "runs": runs, "paths": paths,
                          "second": seconds,
                          "not reached": [s for s in sites
                                          if not calls[s.key] and s.key not in on_path],
                          "seconds": time.perf_counter() - t0}
        if progress is not None:
            progress(design)
    return report


def failures(report: dict) -> list[FaultRun]:
    return [r for d in report.values() for r in (*d["runs"], *d["second"]) if r.problems]


def describe_failure(r: FaultRun) -> str:
    cats = sorted({c for c, _ in r.problems}, key=lambda c: (c not in CATEGORIES, c))
    after = "".join(f" after a {first} fault" for first in r.also)
    return f"{r.design}: {r.site.key} call {r.k}{after}: {', '.join(cats)} " \
        f"({r.problems[0][1]})"


def recovery_figures(runs: Iterable[FaultRun]) -> dict:
    """Totals over fault runs: faults fired, recoveries, StepFailed raised, requests blamed,
    tokens recomputed (the metric), time to recover (median and max ms)."""
    runs = list(runs)
    ms = [m for r in runs for m in r.result.recovery_ms]
    return {"fired": sum(len(r.result.fired) for r in runs),
            "recoveries": sum(r.result.recoveries for r in runs),
            "step failed": sum(r.result.step_failed for r in runs),
            "blamed": sum(len(r.result.blamed) for r in runs),
            "recomputed": int(sum(r.result.metric_recomputed for r in runs)),
            "counted": sum(r.result.recomputed_tokens for r in runs),
            "median ms": statistics.median(ms) if ms else 0.0,
            "max ms": max(ms, default=0.0)}

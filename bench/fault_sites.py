"""Fault injection that can see everything an engine step does: every method a step runs
through is a fault site, each faulted once per run beside a clean run of the same workload.

Used by ``tests/test_fault_sites.py`` (a sample of it, and the detector proofs) and by
``bench/chaos.py`` (the whole sweep, per design).

* **Sites** (:func:`enumerate_sites`): every function a step can call, found by walking the
  classes and modules in :data:`SOURCES`, never listed by hand: each class's methods, static
  and class methods and properties (getters) along its MRO up to ``object``, and each module's
  own functions. A site is ``(owner, name)``, its owner the class that defines it (an inherited
  method is one site, the base's) or the module; ``kind`` says which part of the engine it is
  (manager, pool, prefix cache, radix tree, scheduler, output processing, engine step, runner,
  sampler, metrics, request, connector: a KV connector's, reached only by a design with one,
  such as :data:`OFFLOAD_DESIGN`).
* **Faults** (:class:`Injector`): a site is wrapped where every caller finds it: on the class
  (instances and bound methods fetched later see it), or, for a function, in every
  ``course_lib`` module that bound it by name (``from .sampler import sample`` binds
  ``llm_engine.sample``: patched there too). Only calls made *during* ``LLMEngine.step``, on
  the thread running it, count; the k-th of them raises ``RuntimeError("injected ...")`` once.
  Install before the engine is built, so that bound methods kept at construction (a pool's
  ``on_evict``) are the wrapped ones.
* **Runs** (:func:`run`): one of the four :data:`DESIGNS` (V0 recompute, V0 swap with CPU
  blocks, V1 with the hash prefix cache, V1 with SGLang's radix tree), prefix caching on, a
  pool small enough to preempt, the :func:`workload` (shared prefixes, n > 1, beams for V0,
  top-k logprobs, a salted tenant, a stop token, arriving over steps). After every step:
  ``check_invariants``; after every failed step, everything that must be as before (queues,
  requests, tables, pools, prefix cache or tree, counters, engine maps, metrics, and the K/V
  that means something: each live sequence's computed slots, every cached block) compared
  with a copy taken before it. A failed step (``StepFailed``) is retried. At the end: leaked
  blocks, the engine's own maps, every request answered once. Once the fault has fired and
  a step succeeded, a faulty run whose whole state equals the clean run's at that step
  stops there (the rest would be the clean run's); ``converge=False`` runs it to the end.
* **Blame** (:func:`blame_path`, :func:`blame_run`): request :data:`POISONED` fails in every
  sampling from its second token on, so the engine must finish it alone; one fault at each
  site that finishing it calls (from the scheduler's ``finish_request`` on), compared with
  the run without that fault. **Second faults** (:func:`failure_path`): what handling a
  failed step calls, faulted after a first fault (a double fault; for reading).
* **Comparison** (:func:`compare`): each request not blamed for the fault
  (``finish_reason != "error"``) against the clean run: when nobody was blamed the whole
  ``RequestOutput`` (tokens, cumulative and top-k logprobs, reasons, counts) and the final
  counters and metrics must be identical (a retry continues exactly); when a request was
  blamed the others' batches differ, so their tokens must be identical and their logprobs
  within 1e-4 (float noise of another batch).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))   # memory_helpers

import torch  # noqa: E402
from memory_helpers import snapshot as v0_manager_state  # noqa: E402  (the V0 manager's state)
from memory_helpers import v1_state  # noqa: E402  (a V1 or radix manager's state)

from course_lib.config import CacheConfig, SchedulerConfig  # noqa: E402
from course_lib.engine.llm_engine import LLMEngine  # noqa: E402
from course_lib.engine.rollback import StepFailed  # noqa: E402
from course_lib.model.tokenizer import ByteTokenizer  # noqa: E402
from course_lib.sequence import SamplingParams  # noqa: E402

# ------------------------------------------------------------------------------ sites
# (kind, module, class names; None: the module's own functions; "*": every class defined in it)
SOURCES: list[tuple[str, str, list[str] | str | None]] = [
    ("manager", "course_lib.memory.v0.manager", ["BlockManager"]),
    ("manager", "course_lib.memory.v0.fast", ["FastBlockManager"]),
    ("prefix cache", "course_lib.memory.v0.fast", ["FastPrefixCache"]),
    ("pool", "course_lib.memory.v0.pool", ["BlockAllocator"]),
    ("prefix cache", "course_lib.memory.v0.prefix_cache", ["PrefixCache"]),
    ("manager", "course_lib.memory.v0.block_table", ["BlockTable"]),
    ("manager", "course_lib.memory.v1.kv_cache_manager", ["KVCacheManager"]),
    ("pool", "course_lib.memory.v1.block_pool", ["BlockPool", "FreeKVCacheBlockQueue"]),
    ("manager", "course_lib.memory.radix.kv_cache_manager", ["RadixKVCacheManager"]),
    ("radix tree", "course_lib.memory.radix.radix_cache", ["RadixCache"]),
    ("pool", "course_lib.memory.radix.allocator", "*"),
    ("scheduler", "course_lib.scheduler.scheduler", ["Scheduler"]),
    ("scheduler", "course_lib.scheduler.v1", ["SchedulerV1"]),
    ("scheduler", "course_lib.scheduler.admission", None),
    ("scheduler", "course_lib.scheduler.policy", None),
    ("scheduler", "course_lib.scheduler.policy", ["SchedulingBudget"]),
    ("output processing", "course_lib.scheduler.output_processor", None),
    ("output processing", "course_lib.engine.outputs", None),
    ("engine step", "course_lib.engine.llm_engine", ["LLMEngine"]),
    ("engine step", "course_lib.engine.rollback", None),
    ("engine step", "course_lib.engine.rollback", ["StepTransaction"]),
    ("engine step", "course_lib.checkpoint", None),
    ("engine step", "course_lib.checkpoint", "*"),
    ("runner", "course_lib.engine.model_runner", ["ModelRunner"]),
    ("runner", "course_lib.kernels.cache_ops", None),
    ("runner", "course_lib.kernels.reference", None),      # the CPU backend's cache writes,
    ("runner", "course_lib.kernels.batched", None),        # copies and attention
    ("sampler", "course_lib.engine.sampler", None),
    ("sampler", "course_lib.engine.logprobs", None),
    ("metrics", "course_lib.scheduler.metrics", ["Metrics"]),
    ("request", "course_lib.sequence", ["Request", "Sequence", "SamplingParams"]),
    ("connector", "course_lib.scheduler.kv_connector", ["KVConnectorScheduler"]),
    ("connector", "course_lib.engine.kv_connector", ["KVConnectorBase_V1"]),
    ("connector", "course_lib.engine.cpu_offload", ["CPUOffloadConnector", "CPUBlockPool"]),
]
KINDS = ("manager", "pool", "prefix cache", "radix tree", "scheduler", "output processing",
         "engine step", "runner", "sampler", "metrics", "request", "connector")
# The entry point itself (the harness marks the step with it); and how a checkpoint reads a
# class's fields, worked out once per class and process (before any recorded step), so a
# fault there never fires in a later run.
SKIP = {("LLMEngine", "step"), ("_Layout", "__new__")}


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


def enumerate_sites() -> list[Site]:
    """Every site of :data:`SOURCES`, once (an inherited method belongs to its defining
    class, with the kind of the first source that reached it), in a stable order."""
    sites: dict[tuple[int, str], Site] = {}
    for kind, modname, names in SOURCES:
        mod = importlib.import_module(modname)
        short = modname.rsplit(".", 1)[-1]
        if names is None:
            for name, value in vars(mod).items():
                if inspect.isfunction(value) and value.__module__ == modname \
                        and (id(mod), name) not in sites:
                    sites[id(mod), name] = Site(kind, mod, name, f"{short}.{name}", "function")
            continue
        classes = [v for v in vars(mod).values() if inspect.isclass(v)
                   and v.__module__ == modname] if names == "*" \
            else [getattr(mod, n) for n in names]
        for cls in classes:
            for owner in cls.__mro__:
                if owner is object:
                    continue
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
    """Where each function is bound in ``course_lib``: ``id(fn) -> [(module, name), ...]``
    for every module attribute (``from .sampler import sample`` is one), and
    ``(function, i)`` for a default argument (``victim_policy=last_arrived_first``).
    Built once, and again for modules imported since."""
    names = {n for n, m in sys.modules.items() if n.startswith("course_lib") and m is not None}
    if names - _INDEXED:
        _BINDINGS.clear()
        for n in names:
            mod = sys.modules[n]
            for name, value in list(vars(mod).items()):
                if inspect.isfunction(value):
                    _BINDINGS.setdefault(id(value), []).append((mod, name))
            funcs = [v for v in vars(mod).values() if inspect.isfunction(v)]
            for cls in (v for v in vars(mod).values() if inspect.isclass(v)
                        and v.__module__ == n):
                funcs += [v for v in vars(cls).values() if inspect.isfunction(v)]
            for f in funcs:
                for i, d in enumerate(f.__defaults__ or ()):
                    if inspect.isfunction(d):
                        _BINDINGS.setdefault(id(d), []).append((f, i))
        _INDEXED.clear()
        _INDEXED.update(names)
    return _BINDINGS

class InjectedFault(RuntimeError):
    """What an armed site raises (a ``RuntimeError``, as a transient device error would)."""


class Injector:
    """Wraps ``sites`` (a context manager): counts their calls during steps (``calls``) and
    raises once at each armed ``(site label, k)`` of ``plan`` (``fired`` records
    ``(label, k, step attempt)``). ``hooks[label]`` are called with the call's arguments
    before it runs (for tests that change a site's behaviour)."""

    def __init__(self, sites: Iterable[Site], plan: Iterable[tuple[str, int]] = (),
                 hooks: dict[str, Callable] | None = None) -> None:
        self.sites = list(sites)
        self.plan = set(plan)
        self.hooks = hooks or {}
        self.calls: Counter = Counter()
        self.fired: list[tuple[str, int, int]] = []
        self.step_thread: int | None = None
        self.steps = 0                              # step() calls entered
        # calls when the first fault fired, and when the step it fired in ended: what the
        # failure's handling (rollback, diagnosis, blame) called in between
        self.at_fire: Counter | None = None
        self.after_fire: Counter | None = None
        self._undo: list[Callable[[], None]] = []

    def in_step(self) -> bool:
        return self.step_thread == threading.get_ident()

    def _wrap(self, site: Site, fn: Callable) -> Callable:
        inj, key = self, site.key

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if inj.step_thread == threading.get_ident():
                n = inj.calls[key] = inj.calls[key] + 1
                if (key, n) in inj.plan:
                    inj.plan.discard((key, n))
                    inj.fired.append((key, n, inj.steps))
                    if inj.at_fire is None:
                        inj.at_fire = Counter(inj.calls)
                    raise InjectedFault(f"injected at {key} call {n}")
                hook = inj.hooks.get(key)
                if hook is not None:
                    hook(*args, **kwargs)
            return fn(*args, **kwargs)
        wrapper.__fault_site__ = key
        return wrapper

    def _set(self, owner, name, value) -> None:
        old = vars(owner)[name] if isinstance(owner, type) else getattr(owner, name)
        setattr(owner, name, value)
        self._undo.append(lambda: setattr(owner, name, old))

    def _set_default(self, fn, index, value) -> None:
        old = fn.__defaults__
        fn.__defaults__ = old[:index] + (value,) + old[index + 1:]
        self._undo.append(lambda: setattr(fn, "__defaults__", old))

    def __enter__(self) -> Injector:
        try:
            self._install()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _install(self) -> None:
        inj = self
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
        self._set(LLMEngine, "step", step)
        for site in self.sites:
            if site.what == "function":
                fn = getattr(site.owner, site.name)
                wrapped = self._wrap(site, fn)
                for holder, name in _bindings().get(id(fn), ()):
                    if isinstance(name, int):                 # a default argument
                        if holder.__defaults__[name] is fn:
                            self._set_default(holder, name, wrapped)
                    elif vars(holder).get(name) is fn:        # a module's name for it
                        self._set(holder, name, wrapped)
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
            self._set(site.owner, site.name, new)

    def __exit__(self, *exc) -> None:
        while self._undo:
            self._undo.pop()()


# --------------------------------------------------------------------------- designs
DESIGNS = {
    "v0 recompute": dict(design="v0", preemption_mode="recompute", num_cpu_blocks=0,
                         prefix_cache="hash"),
    "v0 swap": dict(design="v0", preemption_mode="swap", num_cpu_blocks=16,
                    prefix_cache="hash"),
    "v1 hash": dict(design="v1", preemption_mode="recompute", num_cpu_blocks=0,
                    prefix_cache="hash"),
    "v1 radix": dict(design="v1", preemption_mode="recompute", num_cpu_blocks=0,
                     prefix_cache="radix"),
}
# V1 with a CPU offload tier of 32 blocks (course_lib.engine.cpu_offload): not swept by default
# (tests/test_kv_connector.py adds it to DESIGNS for its own fault runs)
OFFLOAD_DESIGN = dict(design="v1", preemption_mode="recompute", num_cpu_blocks=0,
                      prefix_cache="hash", kv_offloading_size=32 * 8192 / 2**30)


def make_engine(model, design: str, *, num_gpu_blocks: int = 12, budget: int = 32,
                max_num_seqs: int = 16, num_cpu_blocks: int | None = None) -> LLMEngine:
    """A small engine of ``design`` (a :data:`DESIGNS` key): blocks of 4, prefix caching on, a
    pool that preempts under :func:`workload`, a constant clock (timings are data too).
    ``num_cpu_blocks``: the swap space of a design that swaps (default: the design's)."""
    d = DESIGNS[design]
    cpu = d["num_cpu_blocks"] if num_cpu_blocks is None or not d["num_cpu_blocks"] \
        else num_cpu_blocks
    sc = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                         max_model_len=model.config.max_position,
                         preemption_mode=d["preemption_mode"])
    cc = CacheConfig(block_size=4, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=cpu,
                     watermark=0.0, enable_prefix_caching=True, prefix_cache=d["prefix_cache"],
                     kv_offloading_size=d.get("kv_offloading_size"))
    return LLMEngine(model, sc, cc, stop_token_ids=(), design=d["design"], clock=lambda: 0.0)


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
    request without, which would differ between two runs)."""
    tok, mt = ByteTokenizer(), max_tokens
    shared = "In the beginning God created "
    space = tok.encode(" ", add_bos=False)[0]
    beams = SamplingParams(max_tokens=mt, beam_width=2, seed=5) \
        if DESIGNS[design]["design"] == "v0" \
        else SamplingParams(max_tokens=mt, n=2, temperature=0.9, seed=11)
    rows = [
        (0, shared + "the heaven", SamplingParams(max_tokens=mt, temperature=0.0, logprobs=2,
                                                  seed=1), None),
        (0, shared + "the earth", SamplingParams(max_tokens=mt, n=2, temperature=0.8, seed=3),
         None),
        (1, "And God said, Let there", SamplingParams(max_tokens=mt + 2, temperature=0.0,
                                                      stop_token_ids=[space], seed=4), None),
        (1, shared + "light", beams, None),
        (2, "Jesus wept. And the", SamplingParams(max_tokens=mt, n=3, temperature=0.7, seed=6,
                                                  logprobs=1), None),
        (2, shared + "the heaven", SamplingParams(max_tokens=mt, n=2, temperature=0.0, seed=8),
         "tenant-b"),
        (3, shared + "the heaven and", SamplingParams(max_tokens=mt, temperature=0.9, seed=7),
         None),
    ]
    return [Arrival(s, tok.encode(p), sp, salt) for s, p, sp, salt in rows]


# ----------------------------------------------------------------------- what is state
def _live_seqs(engine: LLMEngine) -> list:
    s = engine.scheduler
    if engine.design == "v0":
        return [q for queue in (s.waiting, s.running, s.swapped) for r in queue
                for q in r.unfinished_seqs]
    return [*s.waiting, *s.running]


def _requests(engine: LLMEngine) -> list:
    s = engine.scheduler
    if engine.design == "v0":
        return [r for queue in (s.waiting, s.running, s.swapped) for r in queue]
    return list({id(r): r for r in s.requests.values()}.values())


def _manager_state(engine: LLMEngine):
    """The block manager's tables, pools and prefix cache (or tree), read through its
    public state, never through its own snapshot."""
    bm = engine.block_manager
    if engine.design == "v0":
        return v0_manager_state(bm)
    return v1_state(bm)


def _content(engine: LLMEngine) -> list[torch.Tensor]:
    """The K/V that means something: each live sequence's computed slots (GPU, or CPU while
    swapped out) and every cached block (a later prompt may hit it)."""
    bm, r, bs = engine.block_manager, engine.runner, engine.block_manager.block_size
    out = []
    for seq in _live_seqs(engine):
        if not bm.has_seq(seq.seq_id):
            continue
        if engine.design == "v0":
            table = bm.get_table(seq.seq_id)
            caches = r.gpu_caches if table.device == "gpu" else r.cpu_caches
            slots = table.slot_mapping()[:seq.num_computed_tokens]
        else:
            caches, blocks = r.gpu_caches, bm.get_block_table(seq.seq_id)
            slots = [blocks[p // bs] * bs + p % bs for p in range(seq.num_computed_tokens)]
        idx = torch.tensor(slots, dtype=torch.long)
        out += [c.flatten(0, 1)[idx].clone() for layer in caches for c in layer]
    if engine.design == "v0":
        cached = bm.gpu.evictable_block_ids()
    elif hasattr(bm, "block_pool"):
        cached = [b.block_id for b in bm.block_pool.blocks
                  if b.ref_cnt == 0 and b.block_hash is not None]
    else:
        cached = sorted(bm._tree_blocks())
    idx = torch.tensor(cached, dtype=torch.long)
    out += [c[idx].clone() for layer in r.gpu_caches for c in layer]
    conn = getattr(engine, "kv_connector", None)
    if conn is not None:                       # the CPU tier's blocks that hold a prefix
        idx = torch.tensor(sorted(b.block_id for b in conn.cpu_pool.hash_to_block.values()),
                           dtype=torch.long)
        out += [c[idx].clone() for layer in conn.cpu_caches for c in layer]
    return out


def _connector_state(engine: LLMEngine):
    """A KV connector's bookkeeping (the CPU tier's), and the scheduler's queue for it."""
    conn, s = getattr(engine, "kv_connector", None), engine.scheduler
    if conn is None:
        return None
    pool = conn.cpu_pool
    return ([(h, pool.lookup(h)) for h in pool.lru_hashes()], sorted(pool.hash_to_block),
            list(pool.free_blocks), pool.num_evictions,
            conn.num_queried_tokens, conn.num_hit_tokens, conn.num_loaded_blocks,
            conn.num_stored_blocks, sorted(conn._finished_recving),
            [q.seq_id for q in s.waiting_for_remote], sorted(s.finished_recving_kv_req_ids),
            {k: [b.block_id for b in v] for k, v in engine.block_manager.delayed_frees.items()})


def _metrics(engine: LLMEngine) -> dict:
    m = engine.metrics
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in m.registry.collect() for s in f.samples
               if not s.name.endswith("_created")}
    return {"samples": samples, "seen": dict(m._seen),
            "token times": sorted(m._last_token_time.values())}


def counters(engine: LLMEngine) -> dict:
    """Counters and metrics: equal to the clean run's at the end when nobody was blamed."""
    s = engine.scheduler
    return {"scheduler": (s.num_steps, s.num_preemptions, s.num_prompt_tokens,
                          s.num_generated_tokens, s._next_seq_id),
            "engine": (engine.num_steps, engine._next_request_id),
            "runner": engine.runner.counters(),
            "prefix cache": tuple(engine.block_manager.prefix_cache_stats),
            "metrics": _metrics(engine)}


def engine_state(engine: LLMEngine) -> tuple[dict, list[torch.Tensor]]:
    """Everything a failed step must leave as it was: ({part: plain data}, K/V content)."""
    s = engine.scheduler
    if engine.design == "v0":
        queues = tuple([r.request_id for r in q] for q in (s.waiting, s.running, s.swapped))
    else:
        queues = ([q.seq_id for q in s.waiting], [q.seq_id for q in s.running],
                  sorted((k, r.request_id) for k, r in s.requests.items()), sorted(s.preempted))
    reqs = {}
    for r in _requests(engine):
        reqs[r.request_id] = (
            r.first_scheduled_time, r.first_token_time, r.finished_time, r.finish_reason,
            r.finish_detail, r.num_preemptions, r.num_cached_tokens,
            [(q.seq_id, q.index, q.status, q.num_computed_tokens, list(q.output_token_ids),
              q.cumulative_logprob, [list(t) for t in q.output_logprobs]) for q in r.seqs])
    plain = {"queues": queues, "requests": reqs, "manager": _manager_state(engine),
             "connector": _connector_state(engine),
             **counters(engine),
             "engine maps": (sorted(engine._requests), sorted(engine._seeds.items())),
             "last_output": id(engine.last_output)}
    return plain, _content(engine)


def state_diff(before, after) -> list[str]:
    """The parts of :func:`engine_state` that differ ("K/V content" for the tensors)."""
    (pa, ca), (pb, cb) = before, after
    parts = [k for k in pa if pa[k] != pb.get(k)]
    if not parts and (len(ca) != len(cb) or not all(
            torch.equal(x, y) for x, y in zip(ca, cb, strict=True))):
        parts.append("K/V content")
    return parts


# ------------------------------------------------------------------------------- runs
WRONG_TOKENS = "wrong tokens"
WRONG_LOGPROBS = "wrong logprobs"
OUTPUT_DIFFERS = "output differs"
STATE_CHANGED = "failed step changed state"
DIVERGED = "retry diverged"          # after the retry, not the clean run's state at that step
INVARIANT = "invariant broken"
RAISED = "raised"                    # step() raised something other than StepFailed
WEDGED = "wedged"
LEAKED = "leaked blocks"
MAPS = "engine maps kept"
LOST = "request lost"
DUPLICATE = "answered twice"
COUNTERS = "counters differ"
BLAME = "wrong blame"
NOT_FIRED = "not fired"
CATEGORIES = (WRONG_TOKENS, WRONG_LOGPROBS, OUTPUT_DIFFERS, STATE_CHANGED, DIVERGED, INVARIANT,
              RAISED, WEDGED, LEAKED, MAPS, LOST, DUPLICATE, COUNTERS, BLAME, NOT_FIRED)


@dataclass
class RunResult:
    design: str
    outputs: dict = field(default_factory=dict)      # request_id -> RequestOutput
    steps: int = 0                                   # step() calls
    rolled_back: int = 0                             # StepFailed raised
    blamed: list[int] = field(default_factory=list)  # finished with "error"
    problems: list[tuple[str, str]] = field(default_factory=list)
    fired: list[tuple[str, int, int]] = field(default_factory=list)
    calls: Counter = field(default_factory=Counter)  # site label -> calls during steps
    final: dict | None = None                        # counters() at the end
    states: dict = field(default_factory=dict)       # num_steps -> engine_state (record=True)
    converged_at: int | None = None                  # step() call after which it was clean's
    leaked: int = 0                                  # GPU + CPU blocks not free at the end

    def categories(self) -> set[str]:
        return {c for c, _ in self.problems}


def run(model, design: str, work: list[Arrival] | None = None, *,
        injector: Injector | None = None, check_steps: bool = True, record: bool = False,
        clean: RunResult | None = None, max_steps: int = 200, max_raises: int = 4,
        between: Callable[[LLMEngine, int], None] | None = None,
        engine_kwargs: dict | None = None) -> RunResult:
    """Run ``work`` (default :func:`workload`) through a fresh engine of ``design``, with
    ``injector`` installed (before the engine is built). Arrivals are keyed on
    ``engine.num_steps`` (a failed step does not advance it), so a faulty run sees the clean
    run's arrivals at the same points. ``between(engine, attempt)`` runs before each step.

    ``check_steps``: compare the state before and after every failed step. ``record``: keep
    :func:`engine_state` before every step (a clean run, for ``clean=``). ``clean``: once the
    fault has fired and a step has succeeded, the state is compared with the clean run's at
    the same ``num_steps``; equal (queues, requests, tables, pools, caches, counters,
    metrics, engine maps, every meaningful K/V slot), the rest of the run is the clean run's
    and it stops there (``converged_at``); different while nobody was blamed, that is
    :data:`DIVERGED` and the run goes on to the end.

    Stops at the first broken invariant, after ``max_raises`` steps in a row that raise
    anything but ``StepFailed`` (wedged), or after ``max_steps`` step() calls (wedged).
    ``engine_kwargs`` go to :func:`make_engine`."""
    work = workload(design) if work is None else work
    res = RunResult(design)
    args = (model, design, work, res, injector, check_steps, record, clean, max_steps,
            max_raises, between, engine_kwargs or {})
    if injector is None:
        _run(*args)
    else:
        with injector:
            _run(*args)
        res.fired, res.calls = list(injector.fired), Counter(injector.calls)
    return res


def _same_as_clean(engine: LLMEngine, clean: RunResult, answered: int) -> list[str] | None:
    """None if the engine's state equals the clean run's at the same step (and as many
    requests answered), else the parts that differ."""
    theirs = clean.states.get((engine.num_steps, answered))
    if theirs is None:
        return ["no clean state at this step"]
    plain, content = engine_state(engine)
    plain = {k: v for k, v in plain.items() if k != "last_output"}
    parts = state_diff((plain, content),
                       ({k: v for k, v in theirs[0].items() if k != "last_output"}, theirs[1]))
    return parts or None


def _run(model, design, work, res, injector, check_steps, record, clean, max_steps, max_raises,
         between, engine_kwargs):
    engine = make_engine(model, design, **engine_kwargs)
    added, raises, last_ok, pending = 0, 0, False, clean is not None
    while True:
        while added < len(work) and work[added].step <= engine.num_steps:
            a = work[added]
            engine.add_request(a.prompt, a.params, request_id=added, arrival_time=float(a.step),
                               cache_salt=a.cache_salt)
            added += 1
        if added == len(work) and not engine.has_unfinished_requests():
            break
        if pending and last_ok and injector is not None and injector.fired:
            pending = False
            if set(res.blamed) <= set(clean.blamed):      # blamed as in the reference
                parts = _same_as_clean(engine, clean, len(res.outputs))
                if parts is None:             # the clean run from here on: stop
                    res.converged_at = res.steps
                    for rid, o in clean.outputs.items():
                        res.outputs.setdefault(rid, o)
                    res.final = clean.final
                    return
                res.problems.append((DIVERGED, f"after step {res.steps}: {', '.join(parts)}"))
        if res.steps >= max_steps:
            res.problems.append((WEDGED, f"not finished after {max_steps} steps"))
            _lost(res, work)
            return
        if between is not None:
            between(engine, res.steps)
        if record:                  # (a step that blames a request leaves num_steps as is)
            res.states.setdefault((engine.num_steps, len(res.outputs)), engine_state(engine))
        before = engine_state(engine) if check_steps else None
        res.steps += 1
        failed, got = False, []
        try:
            got = engine.step()
            raises = 0
        except StepFailed:
            res.rolled_back += 1
            failed = True
        except Exception as exc:             # noqa: BLE001 - the harness reports it
            res.problems.append((RAISED, f"step {res.steps}: {type(exc).__name__}: {exc}"))
            raises += 1
            failed = True
        last_ok = not failed
        if failed and check_steps:
            parts = state_diff(before, engine_state(engine))
            if parts:
                res.problems.append((STATE_CHANGED, f"step {res.steps}: {', '.join(parts)}"))
        try:
            engine.check_invariants()
        except Exception as exc:              # noqa: BLE001
            res.problems.append((INVARIANT, f"after step {res.steps}: {type(exc).__name__}: "
                                            f"{exc}"))
            return
        for o in got:
            if o.request_id in res.outputs:
                res.problems.append((DUPLICATE, f"request {o.request_id}"))
            res.outputs[o.request_id] = o
            if o.finish_reason == "error":
                res.blamed.append(o.request_id)
        if raises >= max_raises:
            res.problems.append((WEDGED, f"{raises} steps in a row raised"))
            _lost(res, work)
            return
    bm = engine.block_manager
    leaked = (bm.num_gpu_blocks - bm.num_free_gpu_blocks) \
        + (bm.num_cpu_blocks - bm.num_free_cpu_blocks)
    res.leaked = leaked
    if leaked or bm.seq_ids():
        res.problems.append((LEAKED, f"{leaked} blocks, tables of {bm.seq_ids()}"))
    if engine._requests or engine._seeds:
        res.problems.append((MAPS, f"_requests {sorted(engine._requests)}, "
                                   f"_seeds {sorted(engine._seeds)}"))
    _lost(res, work)
    res.final = counters(engine)


def _lost(res: RunResult, work: list[Arrival]) -> None:
    lost = sorted(set(range(len(work))) - res.outputs.keys())
    if lost:
        res.problems.append((LOST, f"requests {lost} never answered"))


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
    """What differs between ``faulty`` and ``clean`` for requests not blamed (module
    docstring); the problems are also appended to ``faulty.problems``. Each fault may blame
    one request, besides ``expected_blamed`` (requests made to fail)."""
    problems = []
    unexpected = [r for r in faulty.blamed if r not in set(expected_blamed)]
    if len(unexpected) > len(faulty.fired):
        problems.append((BLAME, f"{unexpected} blamed for {len(faulty.fired)} faults"))
    exact = not faulty.blamed
    for rid, c in clean.outputs.items():
        f = faulty.outputs.get(rid)
        if f is None or f.finish_reason == "error":
            continue
        ca, fa = _completions(c), _completions(f)
        if [x[1] for x in ca] != [x[1] for x in fa]:
            problems.append((WRONG_TOKENS, f"request {rid}: {[x[1] for x in fa]} instead of "
                                           f"{[x[1] for x in ca]}"))
        elif not (ca == fa if exact else _close(ca, fa, tol)):
            problems.append((WRONG_LOGPROBS, f"request {rid}"))
        elif exact and f != c:
            fields = [k for k in vars(c) if getattr(c, k) != getattr(f, k)]
            problems.append((OUTPUT_DIFFERS, f"request {rid}: {fields}"))
    if exact and faulty.final is not None and clean.final is not None \
            and faulty.final != clean.final:
        parts = [k for k in clean.final if clean.final[k] != faulty.final.get(k)]
        if "metrics" in parts:
            m, n = clean.final["metrics"]["samples"], faulty.final["metrics"]["samples"]
            names = sorted({k[0] for k in m.keys() | n.keys() if m.get(k) != n.get(k)})
            parts[parts.index("metrics")] = f"metrics ({', '.join(names)})"
        problems.append((COUNTERS, ", ".join(parts)))
    faulty.problems += problems
    return problems


# ------------------------------------------------------------------------------ sweep
def reach(model, design: str, sites: list[Site] | None = None) -> tuple[RunResult, Counter]:
    """The clean run of ``design``, recorded (its state before every step), with every site
    counted: (the run, calls per site label during steps). A site with no call is never
    reached by this design's steps."""
    sites = enumerate_sites() if sites is None else sites
    res = run(model, design, injector=Injector(sites), check_steps=False, record=True)
    if res.problems:
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


@dataclass
class FaultRun:
    design: str
    site: Site
    k: int
    result: RunResult
    also: tuple = ()                 # other (site label, k) faulted in the same run

    @property
    def problems(self) -> list[tuple[str, str]]:
        return self.result.problems


def fault_run(model, design: str, site: Site, k: int, clean: RunResult, *,
              converge: bool = True, also: list[tuple[Site, int]] = (),
              hooks: dict | None = None, between: Callable | None = None,
              check_steps: bool = True) -> FaultRun:
    """One run of ``design`` with ``site``'s k-th call during a step failing once, compared
    with ``clean`` (a recorded run: :func:`reach`). ``also``: more (site, k) faults in the
    same run (a first fault that makes a step fail, for a site only a failed step reaches).
    ``converge=False`` runs it to the end even when its state is the clean run's again."""
    plan = [(site.key, k), *((s.key, j) for s, j in also)]
    res = run(model, design, injector=Injector([site, *(s for s, _ in also)], plan, hooks),
              clean=clean if converge else None, max_steps=2 * clean.steps + 20,
              between=between, check_steps=check_steps)
    if (site.key, k) not in {(f[0], f[1]) for f in res.fired}:
        res.problems.append((NOT_FIRED, f"{site.key} call {k} never came"))
    compare(clean, res)
    return FaultRun(design, site, k, res, tuple((s.key, j) for s, j in also))


FIRST_FAULTS = ("ModelRunner.execute_model", "output_processor.apply_samples")


def failure_path(model, design: str, sites: list[Site], clean_calls: Counter
                 ) -> dict[str, tuple[int, dict[str, int]]]:
    """What handling a failed step calls (rollback, diagnosis, blame), for each first fault
    of :data:`FIRST_FAULTS` at its middle call (a forward: ``StepFailed``; a request's
    ``apply_samples``: that request blamed): ``{first fault: (its k, {site label: the k of
    the site's first call after the fault})}``, every site counted in a run of its own."""
    out = {}
    for label in FIRST_FAULTS:
        k = (clean_calls[label] + 1) // 2
        inj = Injector(sites, [(label, k)])
        run(model, design, injector=inj, check_steps=False, max_steps=400)
        before, after = inj.at_fire or Counter(), inj.after_fire or Counter()
        out[label] = (k, {s: before[s] + 1 for s in after
                          if after[s] > before[s] and s != label})
    return out


POISONED = 0        # the request of :func:`workload` whose sampling fails from its 2nd token
FINISH = ("Scheduler.finish_request", "SchedulerV1.finish_request")


def poisoned_run(model, design: str, sites: list[Site], plan: Iterable[tuple[str, int]] = (),
                 *, clean: RunResult | None = None, record: bool = False
                 ) -> tuple[RunResult, Injector]:
    """A run of :func:`workload` in which request :data:`POISONED`'s sampling always fails
    once it has a token (a request whose own work fails: the engine must finish it alone,
    ``finish_reason="error"``), with ``sites`` wrapped and ``plan`` armed. Unless an armed
    fault fired first, the injector's ``at_fire`` holds the calls when the scheduler was
    first asked to finish that request (``finish_request``, the call a blame and an abort
    share, itself not counted yet) and ``after_fire`` those when that step ended."""
    inj = Injector(sites, plan)
    struck = []

    def poison(entry, logits, base_seed):
        if entry.request.request_id == POISONED and entry.seq.output_token_ids:
            struck.append(True)
            raise FloatingPointError("poisoned request")

    def finishing(sched, request_id, *args, _label):
        if struck and request_id == POISONED and inj.at_fire is None:
            inj.at_fire = Counter(inj.calls)
            inj.at_fire[_label] -= 1

    inj.hooks["sampler.sample"] = poison
    for label in FINISH:
        inj.hooks[label] = functools.partial(finishing, _label=label)
    res = run(model, design, injector=inj, check_steps=clean is not None, record=record,
              clean=clean, max_steps=200 if clean is None else 2 * clean.steps + 20)
    return res, inj


def blame_path(model, design: str, sites: list[Site]) -> tuple[RunResult, dict[str, int]]:
    """The reference run with request :data:`POISONED` failing (recorded, for ``clean=``),
    and what finishing it calls once the step is rolled back: {site label: the k of its
    first call from the scheduler's ``finish_request`` on} (the request finished and its
    blocks freed, the engine's maps, the metrics, its output)."""
    base, inj = poisoned_run(model, design, sites, record=True)
    if base.blamed != [POISONED] or base.problems or inj.at_fire is None:
        raise AssertionError(f"the poisoned {design} run: blamed {base.blamed}, "
                             f"problems {base.problems}")
    before, after = inj.at_fire, inj.after_fire
    return base, {s: before[s] + 1 for s in after if after[s] > before[s]}


def blame_run(model, design: str, site: Site, k: int, base: RunResult,
              sites: list[Site]) -> FaultRun:
    """``site``'s k-th call fails once in a run of the poisoned workload (:func:`blame_path`),
    compared with ``base``: the poisoned request alone may fail."""
    by_key = {s.key: s for s in sites}
    res, _ = poisoned_run(model, design, [by_key["sampler.sample"], site], [(site.key, k)],
                          clean=base)
    if (site.key, k) not in {(f[0], f[1]) for f in res.fired}:
        res.problems.append((NOT_FIRED, f"{site.key} call {k} never came"))
    compare(base, res, expected_blamed=[POISONED])
    return FaultRun(design, site, k, res, (("poisoned request", POISONED),))


def sweep(model, designs: Iterable[str] = DESIGNS, *, exhaustive: bool = False,
          converge: bool = True, second_order: bool = False, blame: bool = False,
          sites: list[Site] | None = None,
          ks: Callable[[Site, int, str], list[int]] | None = None,
          progress: Callable[[str], None] | None = None) -> dict:
    """For each design: the clean run, the calls per site, and one fault run per reached
    site and picked k (``ks(site, calls, design)``, default :func:`pick_ks`).
    ``second_order``: also each site the handling of a failed step calls
    (:func:`failure_path`), faulted at its first call after each first fault. ``blame``:
    also each site that finishing a failed request calls (:func:`blame_path`), faulted once
    there. Returns ``{design: {"clean", "calls", "runs", "failure path", "second order",
    "blame", "not reached", "seconds"}}``."""
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
                runs.append(fault_run(model, design, site, k, clean, converge=converge))
        paths = failure_path(model, design, sites, calls)
        second = []
        if second_order:
            for first, (k1, path) in paths.items():
                for label, k2 in sorted(path.items()):
                    second.append(fault_run(model, design, by_label[label], k2, clean,
                                            converge=converge, also=[(by_label[first], k1)]))
        path = {s for _, p in paths.values() for s in p}
        blamed = []
        if blame:
            base, bpath = blame_path(model, design, sites)
            blamed = [blame_run(model, design, by_label[label], k, base, sites)
                      for label, k in sorted(bpath.items())]
        report[design] = {"clean": clean, "calls": calls, "runs": runs,
                          "failure path": path, "second order": second, "blame": blamed,
                          "not reached": [s for s in sites
                                          if not calls[s.key] and s.key not in path],
                          "seconds": time.perf_counter() - t0}
        if progress is not None:
            progress(design)
    return report


def failures(report: dict, second_order: bool = True) -> list[FaultRun]:
    return [r for d in report.values()
            for r in (*d["runs"], *d.get("blame", ()),
                      *(d["second order"] if second_order else ()))
            if r.problems]


def describe_failure(r: FaultRun) -> str:
    cats = sorted({c for c, _ in r.problems}, key=lambda c: (c not in CATEGORIES, c))
    after = "".join(f" after {s} {k}" if s == "poisoned request" else f" after {s} call {k}"
                    for s, k in r.also)
    return f"{r.design}: {r.site.key} call {r.k}{after}: {', '.join(cats)} " \
        f"({r.problems[0][1]})"

"""The systems the course's managers model, driven on the same work, for ``block_manager.py``.

* **nano-vllm's** ``BlockManager`` (``nanovllm/engine/block_manager.py``, GeeeekExplorer/
  nano-vllm), driven by nano-vllm's own ``Scheduler`` (``schedule`` / ``postprocess``) on the
  same trace; its calls are recorded with the state of each ``Sequence`` they read, and
  replayed on a fresh manager. nano-vllm is not on PyPI: :func:`vendor_nano_vllm` copies its
  four pure-Python files from a GitHub checkout into ``.fidelity-cache/nano-vllm/`` (ignored);
  without them the bench says so and skips it.
* **vLLM 0.33.0's** ``KVCacheManager`` and **SGLang 0.5.23's** ``RadixCache``, imported from
  the released sources in the fidelity cache with their heavy imports stubbed
  (``tests/fidelity/upstream.py``), driven by the course's own recorded calls translated one
  for one: ``get_computed_blocks`` / ``allocate_slots`` / ``free`` become vLLM's calls on a
  ``Request`` whose block hashes vLLM's hasher extends as tokens arrive; for the radix tree
  ``get_computed_blocks`` is ``match_prefix``, an admission locks the hit path, ``allocate_slots``
  takes whole pages from the course's page allocator (evicting through the tree when short),
  ``cache_computed`` is SGLang's ``cache_unfinished_req`` (insert, free the duplicates,
  match, move the lock) and ``free`` unlocks and gives the private pages back.

Each replay is a list of operations, some marked as set-up (a sequence's tokens growing, its
counters set: the scheduler's work, not the manager's); the bench times the whole list and
the set-up alone, and reports the difference.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import subprocess
import sys
import types
from array import array
from pathlib import Path
from typing import Any

from course_lib.memory.radix.allocator import BlockSlotPool

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".fidelity-cache"
NANO = CACHE / "nano-vllm"
NANO_FILES = ("nanovllm/engine/block_manager.py", "nanovllm/engine/sequence.py",
              "nanovllm/engine/scheduler.py", "nanovllm/sampling_params.py")


# ------------------------------------------------------------------------------ nano-vllm
def vendor_nano_vllm(checkout: Path) -> None:
    """Copy nano-vllm's block manager, sequence, scheduler and sampling params from a git
    checkout (``git clone https://github.com/GeeeekExplorer/nano-vllm``) into the cache."""
    rev = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], check=True,
                         capture_output=True, text=True).stdout.strip()
    for name in NANO_FILES:
        text = subprocess.run(["git", "-C", str(checkout), "show", f"HEAD:{name}"], check=True,
                              capture_output=True, text=True).stdout
        (NANO / name).parent.mkdir(parents=True, exist_ok=True)
        (NANO / name).write_text(text)
    (NANO / "nano-vllm.json").write_text(json.dumps({"repo": "GeeeekExplorer/nano-vllm",
                                                     "commit": rev, "files": NANO_FILES}))


def nano_missing() -> str | None:
    if all((NANO / f).is_file() for f in NANO_FILES):
        return None
    return (f"nano-vllm skipped: {NANO} is missing (not on PyPI; vendor it with "
            f"`python bench/peers.py CHECKOUT` from a clone of GeeeekExplorer/nano-vllm)")


def load_nano() -> types.SimpleNamespace:
    """nano-vllm's modules without its package ``__init__`` (which imports torch) or its
    ``config`` (transformers): empty packages and a stub config."""
    for name, path in (("nanovllm", NANO / "nanovllm"),
                       ("nanovllm.engine", NANO / "nanovllm" / "engine")):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(path)]
        sys.modules[name] = pkg
    sys.modules["nanovllm.config"] = types.SimpleNamespace(Config=object)
    mods = {}
    for short in ("sampling_params", "engine.sequence", "engine.block_manager",
                  "engine.scheduler"):
        name = f"nanovllm.{short}"
        spec = importlib.util.spec_from_file_location(
            name, NANO / "nanovllm" / (short.replace(".", "/") + ".py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        mods[short.rsplit(".", 1)[-1]] = mod
    return types.SimpleNamespace(**mods)


class _NanoRecorder:
    """Stands in for nano-vllm's block manager: logs each call with the state of the
    sequence it reads (tokens, scheduled and cached counts), then forwards it."""

    def __init__(self, target, log: list, index: dict) -> None:
        self._target, self._log, self._index = target, log, index

    def __getattr__(self, name: str):
        fn = getattr(self._target, name)

        def call(seq, *args):
            self._log.append((name, self._index[id(seq)], seq.num_tokens,
                              seq.num_scheduled_tokens, seq.num_cached_tokens, args))
            return fn(seq, *args)
        return call


def record_nano(trace, blocks: int, block_size: int = 16) -> dict:
    """Run nano-vllm's scheduler on the trace (model-free: sampled tokens are random, EOS
    ignored, ``max_tokens`` as the trace says) and record its block-manager calls."""
    import random

    nano = load_nano()
    nano.sequence.Sequence.block_size = block_size
    config = types.SimpleNamespace(max_num_seqs=64, max_num_batched_tokens=4096, eos=-1,
                                   kvcache_block_size=block_size, num_kvcache_blocks=blocks)
    sched = nano.scheduler.Scheduler(config)
    log, index, seqs = [], {}, []
    sched.block_manager = _NanoRecorder(sched.block_manager, log, index)
    for prompt, max_tokens, _ in trace:
        seq = nano.sequence.Sequence(prompt, nano.sampling_params.SamplingParams(
            temperature=1.0, max_tokens=max_tokens, ignore_eos=True))
        index[id(seq)] = len(seqs)
        seqs.append(seq)
        sched.add(seq)
    rng, work, steps = random.Random(1), 0, 0
    while not sched.is_finished():
        batch, is_prefill = sched.schedule()
        running = {id(s) for s in batch if not s.is_finished}
        sched.postprocess(batch, [rng.randrange(32000) for _ in batch], is_prefill)
        work += len(batch) + sum(1 for s in batch if s.is_finished and id(s) in running)
        steps += 1
    return {"log": log, "tokens": [list(s.token_ids) for s in seqs],
            "prompts": [len(p) for p, _, _ in trace], "max_tokens": [m for _, m, _ in trace],
            "blocks": blocks, "block_size": block_size, "work": work, "steps": steps,
            "calls": len(log)}


def _nano_sync(seq, tokens: list[int], num_tokens: int, scheduled: int, cached: int) -> None:
    """Set-up: the sequence as the recorded call saw it (the scheduler's work)."""
    if seq.num_tokens < num_tokens:
        seq.token_ids += tokens[seq.num_tokens:num_tokens]
        seq.last_token = seq.token_ids[-1]
        seq.num_tokens = num_tokens
    seq.num_scheduled_tokens, seq.num_cached_tokens = scheduled, cached


def nano_ops(rec: dict) -> list[tuple]:
    """(fn, args, is_setup) per operation, on a fresh nano-vllm manager."""
    nano = load_nano()
    nano.sequence.Sequence.block_size = rec["block_size"]
    m = nano.block_manager.BlockManager(rec["blocks"], rec["block_size"])
    seqs = [nano.sequence.Sequence(tokens[:n], nano.sampling_params.SamplingParams(
        temperature=1.0, max_tokens=mt, ignore_eos=True))
        for tokens, n, mt in zip(rec["tokens"], rec["prompts"], rec["max_tokens"],
                                 strict=True)]
    ops = []
    for name, i, num_tokens, scheduled, cached, args in rec["log"]:
        ops.append((_nano_sync, (seqs[i], rec["tokens"][i], num_tokens, scheduled, cached),
                    True))
        ops.append((getattr(m, name), (seqs[i], *args), False))
    return ops


# ----------------------------------------------------------------------------- vLLM 0.33
def _fidelity(name: str):
    """tests/fidelity/upstream.py, and the released package's root (or a reason)."""
    root = CACHE / name
    if not root.is_dir():
        return None, (f"{name} skipped: {root} is missing (run `python tests/fidelity/fetch.py`"
                      f" or `make test-fidelity`)")
    sys.path.insert(0, str(ROOT / "tests" / "fidelity"))
    import upstream
    return upstream, root


def _vllm_request(request_id: str, tokens: list[int], hasher, status):
    """vLLM's ``Request`` as its KV-cache manager reads it (the fidelity tests' stand-in)."""
    from vllm_twins import VllmRequest
    return VllmRequest(request_id, tokens, None, hasher, status)


def vllm_ops(rec: dict, course_manager) -> tuple[list[tuple], str | None]:
    """The course's recorded V1 calls, translated to vLLM 0.33.0's ``KVCacheManager``
    (module docstring). ``course_manager``: a fresh course manager, replayed alongside to
    know which sequences hold blocks when they finish."""
    upstream, root = _fidelity("vllm-0.33.0")
    if upstream is None:
        return [], root
    vllm = upstream.load_vllm(root)
    _, blocks, caching = rec["ctor"]
    bs = 16
    utils, iface = vllm.kv_cache_utils, vllm.kv_cache_interface
    hash_fn = vllm.hashing.get_hash_fn_by_name("sha256")
    utils.init_none_hash(hash_fn)
    hasher = utils.get_request_block_hasher(bs, hash_fn)
    spec = iface.FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype="float32")
    config = iface.KVCacheConfig(num_blocks=blocks + 1, kv_cache_tensors=[],
                                 kv_cache_groups=[iface.KVCacheGroupSpec(["layer"], spec)])
    m = vllm.kv_cache_manager.KVCacheManager(
        config, max_model_len=1 << 20, scheduler_block_size=bs, hash_block_size=bs,
        enable_caching=caching, log_stats=True)
    status = vllm.kv_cache_manager.RequestStatus
    reqs: dict[int, Any] = {}
    hits: dict[int, tuple] = {}
    ops: list[tuple] = []
    course = course_manager

    def grow(seq_id, tokens):             # vLLM's Request hashes as tokens arrive: timed
        req = reqs[seq_id]
        new = tokens[req.num_tokens:]
        for tok in new:
            ops.append((req.append_output_token_ids, (tok,), False))
        req.all_token_ids.extend(new)     # (the translation's view; the ops start afresh)

    made: list[Any] = []
    admitted = None
    for name, args, kwargs in course_log_calls(rec):
        seq_id = args[0] if args else None
        if name == "get_computed_blocks":
            tokens = args[1]
            if seq_id not in reqs:
                req = _vllm_request(str(seq_id), tokens, hasher, status.WAITING)
                reqs[seq_id] = req
                made.append(req)
                ops.append((_reset_request, (req, tokens), False))    # its prompt hashed
            else:
                grow(seq_id, tokens)
            ops.append((_vllm_lookup, (m, reqs[seq_id], hits, seq_id), False))
        elif name == "allocate_slots":
            tokens, computed, num_new = args[1], args[2], args[3]
            grow(seq_id, tokens)
            req = reqs[seq_id]
            admission = len(args) > 4
            admitted = seq_id if admission else admitted   # just admitted
            st = (status.PREEMPTED if req.num_preemptions else status.WAITING) if admission \
                else status.RUNNING
            ops.append((_vllm_setup, (req, 0 if admission else computed, st), True))
            ops.append((_vllm_allocate, (m, req, num_new, hits, seq_id, admission), False))
        elif name == "free":
            ops.append((m.free, (reqs[seq_id],), False))
            ops.append((_preempted, (reqs[seq_id],), True))
            reqs[seq_id].num_preemptions += 1
        elif name == "forget":
            if course.has_seq(seq_id):
                ops.append((m.free, (reqs[seq_id],), False))
        elif name == "record_prefix_cache_stats":      # (num_tokens, num_hit): the one
            ops.append((m.record_prefix_cache_stats, (reqs[admitted], args[1]), False))
        _course_apply(course, name, args, kwargs)
    for req in made:                       # the ops rebuild each request from its prompt
        req.num_preemptions = 0
    return ops, None


def _reset_request(req: Any, tokens: list[int]) -> None:
    req.all_token_ids = list(tokens)
    req.block_hashes = []
    req.num_preemptions = 0
    req.block_hashes.extend(req._hasher(req))


def _vllm_setup(req, computed: int, status) -> None:
    req.num_computed_tokens, req.status = computed, status


def _preempted(req) -> None:
    req.num_preemptions += 1


def _vllm_lookup(m, req, hits: dict, seq_id: int) -> None:
    blocks, num_hit, _ = m.get_computed_blocks(req)
    hits[seq_id] = (blocks, num_hit)


def _vllm_allocate(m, req, num_new: int, hits: dict, seq_id: int, admission: bool):
    if admission:
        blocks, num_hit = hits[seq_id]
        out = m.allocate_slots(req, num_new, num_hit, blocks)
    else:
        out = m.allocate_slots(req, num_new)
    return None if out is None else out.get_block_ids()


# --------------------------------------------------------------------------- SGLang 0.5.23
def sglang_ops(rec: dict, course_manager) -> tuple[list[tuple], str | None]:
    """The course's recorded radix calls, translated to SGLang 0.5.23's ``RadixCache`` over
    the course's page allocator (module docstring)."""
    upstream, root = _fidelity("sglang-0.5.23")
    if upstream is None:
        return [], root
    sg = upstream.load_sglang(root)
    _, blocks, _ = rec["ctor"]
    bs = 16
    clock = itertools.count(1)
    sg.radix_cache.time = types.SimpleNamespace(monotonic=lambda: next(clock),
                                                perf_counter=lambda: 0.0)
    pool = _SglangPool(blocks, bs)
    params = sg.cache_init_params.CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=pool, page_size=bs)
    tree = sg.radix_cache.RadixCache(params)
    state = _SglangState(sg, tree, pool, bs, upstream.Tensor)
    ops: list[tuple] = []
    course = course_manager
    for name, args, kwargs in course_log_calls(rec):
        seq_id = args[0] if args else None
        if name == "get_computed_blocks":
            limit = (len(args[1]) - 1) // bs * bs
            ops.append((state.lookup, (seq_id, args[1][:limit]), False))
        elif name == "allocate_slots":
            before = len(course.req_to_blocks.get(seq_id, ()))
            out = _course_apply(course, name, args, kwargs)
            if out is not None:
                hits = len(args[4]) if len(args) > 4 else 0
                ops.append((state.allocate, (seq_id, args[1][:hits * bs], hits,
                                             len(out) - before - hits), False))
            continue
        elif name == "cache_computed":
            num_full = args[2] // bs
            if course.has_seq(seq_id) and num_full > course.num_cached_block.get(seq_id, 0):
                ops.append((state.cache, (seq_id, args[1][:num_full * bs],
                                          args[3] // bs if len(args) > 3 else 0), False))
        elif name == "free" or (name == "forget" and course.has_seq(seq_id)):
            ops.append((state.free, (seq_id,), False))
        _course_apply(course, name, args, kwargs)
    return ops, None


class _SglangPool(BlockSlotPool):
    """The course's page allocator with the method names SGLang's tree calls."""

    device = "cpu"

    def free(self, slots) -> None:
        super().free(list(slots))

    def free_segment(self, slots, start_pos: int = 0) -> None:
        super().free(list(slots))


class _SglangState:
    """The request side SGLang's scheduler keeps: each request's pages and locked node."""

    def __init__(self, sg, tree, pool, bs: int, tensor) -> None:
        self.sg, self.tree, self.pool, self.bs, self.Tensor = sg, tree, pool, bs, tensor
        self.tables: dict[int, list[int]] = {}     # slot ids, per token
        self.cached: dict[int, int] = {}           # tokens that are the tree's
        self.node: dict[int, object] = {}

    def _key(self, tokens):
        return self.sg.radix_cache.RadixKey(array("q", tokens), None)

    def lookup(self, seq_id: int, tokens) -> None:
        base = self.sg.base_prefix_cache
        self.tree.match_prefix(base.MatchPrefixParams(key=self._key(tokens)))

    def _alloc(self, n: int) -> list[int]:
        if self.pool.available_size() < n:
            self.tree.evict(self.sg.base_prefix_cache.EvictParams(
                num_tokens=n - self.pool.available_size()))
        return self.pool.alloc(n)

    def allocate(self, seq_id: int, hit_tokens, hits: int, num_new: int) -> None:
        table = self.tables.setdefault(seq_id, [])
        if hits:
            base = self.sg.base_prefix_cache
            res = self.tree.match_prefix(base.MatchPrefixParams(key=self._key(hit_tokens)))
            node = res.last_device_node
            self.tree.inc_lock_ref(node)
            self.node[seq_id], self.cached[seq_id] = node, hits * self.bs
            table += list(self.tree.path_device_indices(node))
        if num_new > 0:
            table += self._alloc(num_new * self.bs)

    def cache(self, seq_id: int, tokens, prompt_blocks: int) -> None:
        """SGLang's ``cache_unfinished_req``: insert, free duplicates, match, move the lock."""
        base, bs, tree = self.sg.base_prefix_cache, self.bs, self.tree
        table, done = self.tables[seq_id], self.cached.get(seq_id, 0)
        n = len(tokens)
        res = tree.insert(base.InsertParams(key=self._key(tokens),
                                            value=self.Tensor(table[:n])))
        if 0 < prompt_blocks * bs < n:
            tree.insert(base.InsertParams(key=self._key(tokens[:prompt_blocks * bs]),
                                          value=self.Tensor(table[:prompt_blocks * bs])))
        if res.prefix_len > done:
            self.pool.free(table[done:res.prefix_len])
        match = tree.match_prefix(base.MatchPrefixParams(key=self._key(tokens)))
        if seq_id in self.node:
            tree.dec_lock_ref(self.node[seq_id])
        tree.inc_lock_ref(match.last_device_node)
        self.tables[seq_id] = list(tree.path_device_indices(match.last_device_node)) + table[n:]
        self.node[seq_id], self.cached[seq_id] = match.last_device_node, n

    def free(self, seq_id: int) -> None:
        table = self.tables.pop(seq_id)
        self.pool.free(table[self.cached.pop(seq_id, 0):])
        if seq_id in self.node:
            self.tree.dec_lock_ref(self.node.pop(seq_id))


# ------------------------------------------------------------------ the course's log, read
def course_log_calls(rec: dict):
    """The recorded calls with token-list references resolved to lists of the right length
    (for translation, not timed)."""
    lists = rec.get("lists", [])
    for name, args, kwargs in rec["log"]:
        if args is None:
            continue
        yield name, tuple(lists[a.index][:a.length] if type(a).__name__ == "TokenRef" else a
                          for a in args), kwargs


def _course_apply(course, name: str, args: tuple, kwargs: dict):
    """The same call on the course manager replayed alongside the translation."""
    if name == "get_computed_blocks":
        out = course.get_computed_blocks(*args, **kwargs)
        course._last_hits = getattr(course, "_last_hits", {})
        course._last_hits[args[0]] = out[0]
        return out
    if name == "allocate_slots" and len(args) > 4:
        args = (*args[:4], course._last_hits[args[0]], *args[5:])
    return getattr(course, name)(*args, **kwargs)


if __name__ == "__main__":
    vendor_nano_vllm(Path(sys.argv[1]))
    print(f"nano-vllm vendored into {NANO}")

"""Block-manager speed as the scheduler drives it: work per CPU-second, against a baseline.

**Headline (the scheduler's path).** The real scheduler (V0's ``Scheduler``, or V1's
``SchedulerV1`` over the hash chain or the radix tree) runs a trace with the model-free sampler,
and every call it makes on its KV-cache manager is recorded (arguments, results). The bench then
replays exactly that call sequence on a fresh manager and times the replay alone (CPU time),
so the figure is the manager's cost under the scheduler's call pattern, nothing else. Work is
counted in scheduler events, the same for every version: sequences scheduled in a step (a
prefill chunk or a decode token) plus sequences freed.

The trace: 600 requests, each prompt one of 4 shared 512-token system prompts plus 16-128
private tokens, 16-112 output tokens, every 4th request sampled with ``n`` = 2 or 4; 64
sequences at most per step, budget 4096 tokens, block_size 16, prefix caching on (and off).

**Baseline.** ``--baseline REV`` extracts ``course_lib`` of git revision REV, records REV's own
scheduler on the same trace, checks that both versions leave the same block tables, free
blocks and hits after every step, and replays both in interleaved rounds (fresh processes),
printing the median ratio and its spread.

**The plain manager beside it.** For V0 the scheduler runs ``FastBlockManager``, the checked
twin of the ``BlockManager`` the chapters teach (``course_lib/memory/v0/``); the same recorded
calls are also replayed on the plain ``BlockManager`` and its figure printed beside the twin's.

**Leaner pattern** (labelled as such): the old bench's loop (allocate, mark, append, free),
without the scheduler's checks and table copies.

    python bench/block_manager.py                       # this tree: V0, V1, radix; pool sweep
    python bench/block_manager.py --baseline HEAD~3     # ratio against a revision
    python bench/block_manager.py --quick               # small trace, for a smoke test
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import pickle
import platform
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGNS = ("v0", "v1", "radix")


# ------------------------------------------------------------------ the trace (pure data)
def make_trace(num_requests: int, seed: int = 0) -> list[tuple[list[int], int, int]]:
    """[(prompt token ids, max_tokens, n)]: shared prefix + private suffix, some n > 1."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(32000) for _ in range(512)] for _ in range(4)]
    trace = []
    for i in range(num_requests):
        suffix = [rng.randrange(32000) for _ in range(rng.randint(16, 128))]
        n = rng.choice((2, 4)) if i % 4 == 3 else 1
        trace.append((rng.choice(prefixes) + suffix, rng.randint(16, 112), n))
    return trace


# ------------------------------------------------------- worker side (runs in a subprocess)
class Recorder:
    """Stands in for the manager: forwards every call and attribute read, and logs it."""

    def __init__(self, target, log: list) -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_log", log)

    def __getattr__(self, name: str):
        value = getattr(self._target, name)
        if not callable(value):
            self._log.append((name, None, None))          # a property or attribute read
            return value

        def call(*args, **kwargs):
            args = tuple(list(a) if hasattr(a, "__next__") else a for a in args)   # generators
            self._log.append((name, pickle.loads(pickle.dumps(args)), dict(kwargs)))
            return value(*args, **kwargs)
        return call


def _scheduler(design: str, blocks: int, caching: bool):
    try:
        from course_lib.config import CacheConfig, SchedulerConfig
    except ImportError:                       # revisions before the layout of issue 10
        from course_lib.scheduler_config import CacheConfig, SchedulerConfig
    try:
        from course_lib.scheduler.scheduler import Scheduler
        from course_lib.scheduler.v1 import SchedulerV1
    except ImportError:                       # revisions whose scheduler was one module
        from course_lib.scheduler import Scheduler, SchedulerV1

    sc = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096, max_model_len=4096)
    kw = {"prefix_cache": "radix"} if design == "radix" else {}
    cc = CacheConfig(block_size=16, num_gpu_blocks=blocks, watermark=0.0,
                     enable_prefix_caching=caching, **kw)
    return (Scheduler if design == "v0" else SchedulerV1)(sc, cc)


def _fake_samples():
    """The model-free sampler of the code under test (older revisions kept it elsewhere)."""
    try:
        from course_lib.sim.fake_sampler import fake_samples
        return fake_samples
    except ImportError:
        from course_lib.sequence import fake_sample
        return lambda out: {e.seq.seq_id: fake_sample(e.request, e.seq, e.num_samples)
                            for e in out.scheduled if e.num_samples}


def _digest(bm) -> tuple:
    """What both versions must agree on after every step: the tables, free blocks and hits,
    and for V0 the next 64 blocks the free stack and the eviction order would hand out."""
    tables = tuple(sorted((s, tuple(bm.get_block_table(s))) for s in bm.seq_ids()))
    pool = getattr(bm, "gpu", None)
    order = ()
    if pool is not None:
        lru = getattr(pool, "_evictable", None)     # older revisions kept it in the cache
        if lru is None:
            lru = getattr(getattr(bm, "cache", None), "_evictor", {})
        evictable = iter(lru)
        order = (tuple(pool._free[-64:]), tuple(next(evictable, None) for _ in range(64)))
    return tables, bm.num_free_gpu_blocks, tuple(bm.prefix_cache_stats), order


def record(design: str, num_requests: int, blocks: int, caching: bool,
           digests: bool = True) -> dict:
    from course_lib.sequence import SamplingParams

    fake_samples = _fake_samples()
    s = _scheduler(design, blocks, caching)
    real, log = s.block_manager, []
    proxy = Recorder(real, log)
    s.block_manager = proxy
    if hasattr(s, "kv_cache_manager"):
        s.kv_cache_manager = proxy
    for i, (prompt, max_tokens, n) in enumerate(make_trace(num_requests)):
        s.add_request(i, prompt, SamplingParams(max_tokens=max_tokens, n=n, temperature=1.0))
    keep, kept, work, step = digests, [], 0, 0
    while s.has_unfinished_requests():
        out = s.schedule()
        finished = s.update(out, fake_samples(out), float(step))
        work += len(out.scheduled) + sum(len(r.seqs) for r in finished)
        work += sum(1 for _ in out.preempted)
        if keep:
            kept.append(_digest(real))
        step += 1
    return {"log": log, "ctor": (type(real).__name__, blocks, caching), "work": work,
            "digests": kept, "steps": step, "calls": len(log)}


# Where each manager class is defined: this tree's layout first, then older revisions', whose
# ``course_lib.memory`` re-exported them all.
HOMES = {"FastBlockManager": "course_lib.memory.v0.fast",
         "BlockManager": "course_lib.memory.v0.manager",
         "KVCacheManager": "course_lib.memory.v1.kv_cache_manager",
         "RadixKVCacheManager": "course_lib.memory.radix.kv_cache_manager"}


def _manager(ctor, plain: bool = False):
    """A fresh manager like the recorded one; ``plain``: the plain ``BlockManager`` instead of
    the scheduler's twin."""
    import importlib

    name, blocks, caching = ctor
    if plain and name == "FastBlockManager":
        name = "BlockManager"
    try:
        cls = getattr(importlib.import_module(HOMES[name]), name)
    except ImportError:
        cls = getattr(importlib.import_module("course_lib.memory"), name)
    if name in ("BlockManager", "FastBlockManager"):
        return cls(16, blocks, 0, 0.0, caching)
    return cls(16, blocks, caching, 0.0)


def replay(rec: dict, check: bool = False, plain: bool = False) -> float:
    """CPU seconds to replay the recorded calls on a fresh manager (its invariants checked at
    the end when ``check``; ``plain``: on the plain V0 manager, not the twin). The loop is one
    bound call per recorded call, nothing else."""
    m, hits = _manager(rec["ctor"], plain), {}
    ops = []
    for name, args, kwargs in rec["log"]:
        if args is None:                                 # a property or attribute read
            attr = getattr(type(m), name, None)
            ops.append((attr.fget, (m,)) if isinstance(attr, property)
                       else (getattr, (m, name)))
            continue
        fn = getattr(m, name)
        if kwargs:
            fn = functools.partial(fn, **kwargs)
        if name == "get_computed_blocks":                # V1: keep the hits for allocate_slots
            fn = functools.partial(_remember, hits, fn)
        elif name == "allocate_slots" and len(args) > 4 and args[4]:
            fn, args = functools.partial(_with_hits, hits, fn), args
        ops.append((fn, args))
    gc.collect()
    gc.freeze()
    t0 = time.process_time()
    for fn, args in ops:
        fn(*args)
    spent = time.process_time() - t0
    gc.unfreeze()
    if check:
        m.check_invariants()
    return spent


def _remember(hits: dict, fn, seq_id, *args, **kwargs):
    hits[seq_id] = out = fn(seq_id, *args, **kwargs)
    return out


def _with_hits(hits: dict, fn, seq_id, tokens, computed, new, _recorded, *rest, **kwargs):
    return fn(seq_id, tokens, computed, new, hits[seq_id][0], *rest, **kwargs)


def lean(blocks: int, caching: bool) -> tuple[int, float]:
    """The old bench's loop (not the scheduler's pattern): allocate + mark, append, free."""
    from course_lib.memory.common import AllocStatus
    from course_lib.memory.v0.manager import BlockManager

    m = BlockManager(16, blocks, 0, 0.0, caching)
    trace, waiting, live, ops = make_trace(600), None, {}, 0
    waiting = list(enumerate(trace))[::-1]
    t0 = time.process_time()
    while waiting or live:
        while waiting and len(live) < 64 and m.can_allocate(waiting[-1][1][0]) is AllocStatus.OK:
            seq_id, (prompt, out_len, _) = waiting.pop()
            m.allocate(seq_id, prompt)
            m.mark_blocks_as_computed(seq_id, len(prompt))
            live[seq_id] = [out_len, len(prompt)]
            ops += 1
        for seq_id in list(live):
            state = live[seq_id]
            if not m.can_append_slots(seq_id):
                m.free(seq_id)
                del live[seq_id]
                waiting.append((seq_id, trace[seq_id]))
                continue
            m.append_slots(seq_id, (state[1],))
            state[1] += 1
            state[0] -= 1
            ops += 1
            if state[0] == 0:
                m.free(seq_id)
                del live[seq_id]
                ops += 1
    return ops, time.process_time() - t0


def worker(argv: list[str]) -> None:
    root, cmd = argv[0], argv[1]
    sys.path.insert(0, root)
    if cmd == "record":
        design, n, blocks, caching, path = argv[2], int(argv[3]), int(argv[4]), argv[5] == "1", \
            argv[6]
        rec = record(design, n, blocks, caching, digests=argv[7] == "1")
        with open(path, "wb") as f:
            pickle.dump(rec, f)
        print(json.dumps({k: rec[k] for k in ("work", "steps", "calls")}))
    elif cmd == "replay":
        with open(argv[2], "rb") as f:
            rec = pickle.load(f)
        print(json.dumps({"cpu_s": replay(rec, check=argv[3] == "1",
                                          plain=len(argv) > 4 and argv[4] == "1")}))
    elif cmd == "lean":
        ops, spent = lean(int(argv[2]), argv[3] == "1")
        print(json.dumps({"ops": ops, "cpu_s": spent}))


# ------------------------------------------------------------------------- driver side
def run_worker(root: Path, *args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--worker", str(root), *args], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def extract(rev: str, into: Path) -> Path:
    """``course_lib`` of a git revision, in a folder of its own."""
    data = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "course_lib"], check=True,
                          capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def check_same(digests: dict[str, list]) -> None:
    """The versions must leave the same tables, free blocks, hits (and, for V0, the same free
    stack and eviction order) after every step: a faster version that schedules differently
    is not the same work."""
    (first, want), *rest = digests.items()
    for label, got in rest:
        if got != want:
            step = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b),
                        min(len(want), len(got)))
            raise AssertionError(f"{label} and {first} differ after step {step} "
                                 f"({len(got)} vs {len(want)} steps)")


def compare(roots: dict[str, Path], design: str, n: int, blocks: int, caching: bool,
            rounds: int, tmp: Path, plain: bool = False) -> dict[str, list[float]]:
    """Record each version, check they agree step by step, replay interleaved; ``plain``:
    also replay this tree's recorded V0 calls on the plain ``BlockManager``."""
    recs, meta = {}, {}
    for label, root in roots.items():
        recs[label] = tmp / f"{label}-{design}-{blocks}-{caching}.pkl"
        meta[label] = run_worker(root, "record", design, str(n), str(blocks),
                                 "1" if caching else "0", str(recs[label]),
                                 "1" if len(roots) > 1 else "0")
    if len(roots) > 1:
        check_same({label: pickle.loads(p.read_bytes())["digests"]
                    for label, p in recs.items()})
    for label, root in roots.items():           # one checked run (invariants) per version
        run_worker(root, "replay", str(recs[label]), "1")
    plain = plain and pickle.loads(recs["this tree"].read_bytes())["ctor"][0] == "FastBlockManager"
    if plain:
        run_worker(ROOT, "replay", str(recs["this tree"]), "1", "1")
    times: dict[str, list[float]] = {label: [] for label in roots}
    for _ in range(rounds):
        for label, root in roots.items():
            times[label].append(run_worker(root, "replay", str(recs[label]), "0")["cpu_s"])
        if plain:
            times.setdefault("plain BlockManager", []).append(
                run_worker(ROOT, "replay", str(recs["this tree"]), "0", "1")["cpu_s"])
    meta["plain BlockManager"] = meta["this tree"]
    return {label: [meta[label]["work"] / t for t in ts] for label, ts in times.items()} | {
        "calls": {label: meta[label]["calls"] for label in times}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="150 requests, 2 rounds")
    parser.add_argument("--baseline", help="a git revision to compare with")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    n, rounds = (150, 2) if args.quick else (600, args.rounds)
    print(f"machine: {cpu_name()}, python {sys.version.split()[0]}, one process per replay, "
          f"CPU time of the replayed calls only")
    print(f"trace: {n} requests, 4 shared 512-token prefixes, 1 in 4 with n = 2 or 4, "
          f"16-112 output tokens; block_size 16, 64 seqs and 4096 tokens per step")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        roots = {"this tree": ROOT}
        if args.baseline:
            roots = {args.baseline: extract(args.baseline, tmp / "base"), **roots}
        designs = ("v0",) if args.baseline else DESIGNS
        print("\nheadline: the scheduler's own calls, work (seqs scheduled + freed) per CPU-s")
        for design in designs:
            for caching in (True, False):
                if design == "radix" and not caching:
                    continue
                r = compare(roots, design, n, 2048, caching, rounds, tmp, plain=True)
                cells = [f"{label}: {statistics.median(v):,.0f}/s ({r['calls'][label]:,} calls)"
                         for label, v in r.items() if label != "calls"]
                line = f"  {design:5} caching {'on ' if caching else 'off'}  " + "; ".join(cells)
                if "plain BlockManager" in r:
                    ratio = statistics.median(r["this tree"]) / statistics.median(
                        r["plain BlockManager"])
                    line += f"  (twin / plain x{ratio:.2f})"
                if args.baseline:
                    base, work = r[args.baseline], r["this tree"]
                    ratios = [w / b for w, b in zip(work, base, strict=True)]
                    line += (f"  -> x{statistics.median(work) / statistics.median(base):.2f} "
                             f"(per round {min(ratios):.2f}-{max(ratios):.2f}, {rounds} rounds)")
                print(line)
        if args.baseline:
            return
        print("\nleaner pattern, not the scheduler's (the old bench's loop), V0, this tree:")
        for caching in (True, False):
            res = run_worker(ROOT, "lean", "2048", "1" if caching else "0")
            print(f"  caching {'on ' if caching else 'off'}: {res['ops'] / res['cpu_s']:,.0f} "
                  f"ops/CPU-s")
        print("\npool size sweep (V0, scheduler path, caching on): cost per unit of work")
        base = None
        for blocks in (1_000, 10_000, 100_000, 1_000_000):
            r = compare({"this tree": ROOT}, "v0", n, blocks, True, rounds, tmp)["this tree"]
            us = 1e6 / statistics.median(r)
            base = base or us
            print(f"  {blocks:>9,} blocks: {us:6.2f} us per unit  ({us / base:.2f}x of 1k)")


if __name__ == "__main__":
    main()

"""Block-manager speed as the scheduler drives it: work per CPU-second, beside the systems the
managers model and against a baseline.

**Headline (the scheduler's path).** The real scheduler (V0's ``Scheduler``, or V1's
``SchedulerV1`` over the hash chain or the radix tree) runs a trace with the model-free sampler,
and every call it makes on its KV-cache manager is recorded (arguments; a sequence's token list,
which the scheduler passes on every call, is recorded once and grown in place at replay). The
bench then replays exactly that call sequence on a fresh manager and times the replay alone
(CPU time, less the set-up: the token lists growing), so the figure is the manager's cost under
the scheduler's call pattern, nothing else. Work is counted in scheduler events, the same for
every version: sequences scheduled in a step (a prefill chunk or a decode token) plus sequences
freed.

The trace (issue 25's): 2,000 requests, each prompt one of 8 shared 512-token system prompts
plus 16-128 private tokens, 16-112 output tokens, ``n`` = 1; 64 sequences at most per step,
budget 4096 tokens, block_size 16, 4,096 blocks, prefix caching on (and off for V0).

**Beside the systems modelled** (``peers.py``, each skipped with a message when absent):
V0's twin beside nano-vllm's ``BlockManager`` driven by nano-vllm's own scheduler on the same
trace; V1's ``KVCacheManager`` beside vLLM 0.33.0's (and nano-vllm's); the radix manager beside
SGLang 0.5.23's ``RadixCache``, both on the course's recorded calls translated one for one.
Every ratio is the median of interleaved rounds (fresh processes), with the per-round range.

**The plain manager beside it.** For V0 the scheduler runs ``FastBlockManager``, the checked
twin of the ``BlockManager`` the chapters teach (``course_lib/memory/v0/``); the same recorded
calls are also replayed on the plain ``BlockManager`` and its figure printed beside the twin's.

**Scaling.** The cost of one decode token at sequence lengths 128, 1,024 and 8,192 for each
manager (called as its scheduler calls it, no scheduler), and the cost per unit of work of the
scheduler's path with pools of 1k to 1M blocks: both should be flat.

**Baseline.** ``--baseline REV`` extracts ``course_lib`` of git revision REV, records REV's own
scheduler on the same trace, checks that both versions leave the same block tables, free
blocks and hits after every step, and replays both in interleaved rounds (fresh processes),
printing the median ratio and its spread.

    python bench/block_manager.py                       # this tree, its peers, scaling
    python bench/block_manager.py --baseline HEAD~3     # ratio against a revision (V0)
    python bench/block_manager.py --quick               # small trace, for a smoke test
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
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
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
DESIGNS = ("v0", "v1", "radix")


# ------------------------------------------------------------------ the trace (pure data)
def make_trace(num_requests: int, seed: int = 0, num_prefixes: int = 8
               ) -> list[tuple[list[int], int, int]]:
    """[(prompt token ids, max_tokens, n)]: one of ``num_prefixes`` shared 512-token system
    prompts plus 16-128 private tokens, 16-112 output tokens, ``n`` = 1 (nano-vllm has no
    parallel sampling, and the peers are driven on the same trace)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(32000) for _ in range(512)] for _ in range(num_prefixes)]
    trace = []
    for _ in range(num_requests):
        suffix = [rng.randrange(32000) for _ in range(rng.randint(16, 128))]
        trace.append((rng.choice(prefixes) + suffix, rng.randint(16, 112), 1))
    return trace


class TokenRef(NamedTuple):
    """A recorded token-list argument: the first ``length`` tokens of ``lists[index]``. The
    scheduler passes a sequence's tokens, one more each decode step, on every call; recording
    them once per sequence (not a copy per call, which grows with the sequence) keeps a
    2,000-request log small."""
    index: int
    length: int


def _loggable(a):
    """An argument as the log keeps it: a list of V1 blocks (linked to their neighbours in the
    free queue, which pickle would follow) as their ids; the replay passes the blocks its own
    lookup found instead (``_with_hits``)."""
    if type(a) is list and a and hasattr(a[0], "block_id"):
        return tuple(b.block_id for b in a)
    return a


class Recorder:
    """Stands in for the manager: forwards every call and attribute read, and logs it."""

    def __init__(self, target, log: list, lists: list | None = None) -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_log", log)
        object.__setattr__(self, "_lists", lists)
        object.__setattr__(self, "_owned", {})      # seq id -> index of its tokens in lists

    def _token_ref(self, seq_id: int, a: list) -> TokenRef:
        """``a`` (a sequence's tokens) as a reference into the sequence's recorded list,
        extended when ``a`` continues it, a new one otherwise."""
        index = self._owned.get(seq_id)
        if index is not None:
            stored = self._lists[index]
            if len(a) >= len(stored) and a[:len(stored)] == stored:
                stored += a[len(stored):]
                return TokenRef(index, len(a))
            if len(a) < len(stored) and stored[:len(a)] == a:
                return TokenRef(index, len(a))
        self._lists.append(list(a))
        self._owned[seq_id] = len(self._lists) - 1
        return TokenRef(len(self._lists) - 1, len(a))

    def __getattr__(self, name: str):
        value = getattr(self._target, name)
        if not callable(value):
            self._log.append((name, None, None))          # a property or attribute read
            return value

        def call(*args, **kwargs):
            args = tuple(list(a) if hasattr(a, "__next__") else a for a in args)   # generators
            logged = tuple(_loggable(a) for a in args)     # V1's hit blocks: their ids
            if self._lists is not None and len(args) > 1 and type(args[1]) is list \
                    and args[1] and type(args[1][0]) is int:  # (seq_id, token_ids, ...)
                logged = (args[0], self._token_ref(args[0], args[1]), *logged[2:])
            self._log.append((name, pickle.loads(pickle.dumps(logged)), dict(kwargs)))
            return value(*args, **kwargs)
        return call


def _scheduler(design: str, blocks: int, caching: bool, max_num_seqs: int = 64):
    try:
        from course_lib.config import CacheConfig, SchedulerConfig
    except ImportError:                       # revisions before the layout of issue 10
        from course_lib.scheduler_config import CacheConfig, SchedulerConfig
    try:
        from course_lib.scheduler.scheduler import Scheduler
        from course_lib.scheduler.v1 import SchedulerV1
    except ImportError:                       # revisions whose scheduler was one module
        from course_lib.scheduler import Scheduler, SchedulerV1

    sc = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=4096,
                         max_model_len=4096)
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
    stats = bm.prefix_cache_stats                  # queries and hits, in any revision
    return tables, bm.num_free_gpu_blocks, (stats.queries, stats.hits), order


def record(design: str, num_requests: int, blocks: int, caching: bool,
           digests: bool = True, max_num_seqs: int = 64) -> dict:
    from course_lib.sequence import SamplingParams

    fake_samples = _fake_samples()
    s = _scheduler(design, blocks, caching, max_num_seqs)
    real, log, lists = s.block_manager, [], (None if design == "v0" else [])
    proxy = Recorder(real, log, lists)
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
    return {"log": log, "lists": lists or [], "ctor": (type(real).__name__, blocks, caching),
            "work": work, "digests": kept, "steps": step, "calls": len(log)}


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


def course_ops(rec: dict, plain: bool = False) -> tuple[object, list[tuple]]:
    """A fresh manager and the recorded calls on it as (fn, args, is_setup): one bound call
    per recorded call; a token list grows in place before the call that reads it longer
    (set-up: the scheduler's appends)."""
    m, hits = _manager(rec["ctor"], plain), {}
    lists = rec.get("lists", [])
    live, length = [[] for _ in lists], [0] * len(lists)
    ops = []
    for name, args, kwargs in rec["log"]:
        if args is None:                                 # a property or attribute read
            attr = getattr(type(m), name, None)
            ops.append((attr.fget, (m,), False) if isinstance(attr, property)
                       else (getattr, (m, name), False))
            continue
        resolved = []
        for a in args:
            if type(a).__name__ == "TokenRef":
                if length[a.index] < a.length:
                    ops.append((live[a.index].extend,
                                (lists[a.index][length[a.index]:a.length],), True))
                    length[a.index] = a.length
                a = live[a.index] if length[a.index] == a.length \
                    else lists[a.index][:a.length]
            resolved.append(a)
        args = tuple(resolved)
        fn = getattr(m, name)
        if kwargs:
            fn = functools.partial(fn, **kwargs)
        if name == "get_computed_blocks":                # V1: keep the hits for allocate_slots
            fn = functools.partial(_remember, hits, fn)
        elif name == "allocate_slots" and len(args) > 4 and args[4]:
            fn = functools.partial(_with_hits, hits, fn)
        ops.append((fn, args, False))
    return m, ops


def time_ops(make_ops) -> float:
    """CPU seconds of the operations ``make_ops()`` builds, less their set-up alone (built
    afresh, so that lists grow from empty again)."""
    spent = []
    for setup_only in (False, True):
        ops = [(fn, args) for fn, args, setup in make_ops() if setup or not setup_only]
        gc.collect()
        gc.freeze()
        t0 = time.process_time()
        for fn, args in ops:
            fn(*args)
        spent.append(time.process_time() - t0)
        gc.unfreeze()
        del ops
    return spent[0] - spent[1]


def replay(rec: dict, check: bool = False, plain: bool = False) -> float:
    """CPU seconds to replay the recorded calls on a fresh manager (its invariants checked at
    the end when ``check``; ``plain``: on the plain V0 manager, not the twin)."""
    made = []

    def make():
        m, ops = course_ops(rec, plain)
        made.append(m)
        return ops
    spent = time_ops(make)
    if check:
        made[0].check_invariants()
    return spent


def peer_replay(kind: str, rec: dict) -> dict:
    """CPU seconds of the peer ``kind`` on the same work, or the reason it is skipped."""
    import peers

    if kind == "nano-vllm":
        if peers.nano_missing():
            return {"skip": peers.nano_missing()}
        return {"cpu_s": time_ops(lambda: peers.nano_ops(rec))}
    translate = peers.vllm_ops if kind == "vllm" else peers.sglang_ops
    ops, why = translate(rec, _manager(rec["ctor"]))
    if why:
        return {"skip": why}
    first = [ops]
    return {"cpu_s": time_ops(lambda: first.pop() if first else
                              translate(rec, _manager(rec["ctor"]))[0])}


def _remember(hits: dict, fn, seq_id, *args, **kwargs):
    hits[seq_id] = out = fn(seq_id, *args, **kwargs)
    return out


def _with_hits(hits: dict, fn, seq_id, tokens, computed, new, _recorded, *rest, **kwargs):
    return fn(seq_id, tokens, computed, new, hits[seq_id][0], *rest, **kwargs)


# ----------------------------------------------------------------- scaling (no scheduler)
def decode_cost(design: str, length: int, num_seqs: int = 32, tokens: int = 256) -> float:
    """Microseconds of CPU per decode token for ``num_seqs`` sequences of ``length`` tokens,
    each decoding ``tokens`` more, called as each manager's scheduler calls it (V0:
    ``append_decode``, and ``mark_blocks_as_computed`` after a token that completed a block;
    V1: ``allocate_slots``; radix:
    ``allocate_slots``, and ``cache_computed`` when a block fills)."""
    import random

    rng = random.Random(length)
    bs = 16
    blocks = num_seqs * ((length + tokens) // bs + 2) + 64
    ctor = {"v0": ("FastBlockManager", blocks, True), "v1": ("KVCacheManager", blocks, True),
            "radix": ("RadixKVCacheManager", blocks, True)}[design]
    m = _manager(ctor)
    seqs = {i: [rng.randrange(32000) for _ in range(length)] for i in range(num_seqs)}
    new = {i: [rng.randrange(32000) for _ in range(tokens)] for i in seqs}
    for i, toks in seqs.items():                          # prefill, untimed
        if design == "v0":
            m.allocate(i, toks)
            m.mark_blocks_as_computed(i, len(toks))
        else:
            m.allocate_slots(i, toks, 0, len(toks))
            if design == "radix":
                m.cache_computed(i, toks, len(toks), length)
    gc.collect()
    gc.freeze()                    # as in replay: the collector does not walk the prefill
    t0 = time.process_time()
    for k in range(tokens):
        for i, toks in seqs.items():
            tok = new[i][k]
            if design == "v0":
                m.append_decode([i], [tok])
                computed = length + k + 1                 # the step computes tok too
                if computed % bs == 0:                    # tok completed a block: marked
                    m.mark_blocks_as_computed(i, computed)  # after its step (_mark_computed)
            else:
                toks.append(tok)
                m.allocate_slots(i, toks, len(toks) - 1, 1)
                if design == "radix" and len(toks) % bs == 0:
                    m.cache_computed(i, toks, len(toks), length)
    spent = time.process_time() - t0
    gc.unfreeze()
    return spent / (tokens * num_seqs) * 1e6


def worker(argv: list[str]) -> None:
    root, cmd = argv[0], argv[1]
    sys.path.insert(0, root)
    if cmd == "record":
        design, n, blocks, caching, path = argv[2], int(argv[3]), int(argv[4]), argv[5] == "1", \
            argv[6]
        rec = record(design, n, blocks, caching, digests=argv[7] == "1",
                     max_num_seqs=int(argv[8]) if len(argv) > 8 else 64)
        with open(path, "wb") as f:
            pickle.dump(rec, f)
        print(json.dumps({k: rec[k] for k in ("work", "steps", "calls")}))
    elif cmd == "replay":
        with open(argv[2], "rb") as f:
            rec = pickle.load(f)
        print(json.dumps({"cpu_s": replay(rec, check=argv[3] == "1",
                                          plain=len(argv) > 4 and argv[4] == "1")}))
    elif cmd == "peer":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        with open(argv[3], "rb") as f:
            rec = pickle.load(f)
        print(json.dumps(peer_replay(argv[2], rec)))
    elif cmd == "record-nano":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import peers

        if peers.nano_missing():
            print(json.dumps({"skip": peers.nano_missing()}))
            return
        rec = peers.record_nano(make_trace(int(argv[2])), int(argv[3]))
        with open(argv[4], "wb") as f:
            pickle.dump(rec, f)
        print(json.dumps({k: rec[k] for k in ("work", "steps", "calls")}))
    elif cmd == "decode":
        print(json.dumps({"us": decode_cost(argv[2], int(argv[3]), int(argv[4]))}))


# ------------------------------------------------------------------------- driver side
def run_worker(root: Path, *args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--worker", str(root), *args],
                         capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"worker {' '.join(args)} failed:\n{out.stderr}")
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


PEERS = {"v0": ("nano-vllm",), "v1": ("vllm", "nano-vllm"), "radix": ("sglang",)}
PEER_NAMES = {"nano-vllm": "nano-vllm BlockManager", "vllm": "vLLM 0.33.0 KVCacheManager",
              "sglang": "SGLang 0.5.23 RadixCache"}


def compare(roots: dict[str, Path], design: str, n: int, blocks: int, caching: bool,
            rounds: int, tmp: Path, plain: bool = False, peers: tuple[str, ...] = (),
            max_num_seqs: int = 64) -> dict[str, list[float]]:
    """Record each version, check they agree step by step, replay interleaved; ``plain``:
    also replay this tree's recorded V0 calls on the plain ``BlockManager``; ``peers``: also
    the systems modelled (``peers.py``) on the same work, each round."""
    recs, meta = {}, {}
    for label, root in roots.items():
        recs[label] = tmp / f"{label}-{design}-{blocks}-{caching}.pkl"
        meta[label] = run_worker(root, "record", design, str(n), str(blocks),
                                 "1" if caching else "0", str(recs[label]),
                                 "1" if len(roots) > 1 else "0", str(max_num_seqs))
    if len(roots) > 1:
        check_same({label: pickle.loads(p.read_bytes())["digests"]
                    for label, p in recs.items()})
    for label, root in roots.items():           # one checked run (invariants) per version
        run_worker(root, "replay", str(recs[label]), "1")
    plain = plain and pickle.loads(recs["this tree"].read_bytes())["ctor"][0] == "FastBlockManager"
    if plain:
        run_worker(ROOT, "replay", str(recs["this tree"]), "1", "1")
    skipped, peer_recs = {}, {}
    for peer in peers if caching else ():
        if peer == "nano-vllm":
            path = tmp / f"nano-{n}-{blocks}.pkl"
            if not path.exists():
                got = run_worker(ROOT, "record-nano", str(n), str(blocks), str(path))
                if "skip" in got:
                    skipped[peer] = got["skip"]
                    continue
                meta["nano-vllm-work"] = got
            peer_recs[peer] = (path, meta.get("nano-vllm-work") or
                               {"work": pickle.loads(path.read_bytes())["work"],
                                "calls": pickle.loads(path.read_bytes())["calls"]})
        else:
            peer_recs[peer] = (recs["this tree"], meta["this tree"])
    times: dict[str, list[float]] = {label: [] for label in roots}
    for _ in range(rounds):
        for label, root in roots.items():
            times[label].append(run_worker(root, "replay", str(recs[label]), "0")["cpu_s"])
        if plain:
            times.setdefault("plain BlockManager", []).append(
                run_worker(ROOT, "replay", str(recs["this tree"]), "0", "1")["cpu_s"])
        for peer, (path, _) in list(peer_recs.items()):
            got = run_worker(ROOT, "peer", peer, str(path))
            if "skip" in got:
                skipped[peer] = got["skip"]
                del peer_recs[peer]
                continue
            times.setdefault(PEER_NAMES[peer], []).append(got["cpu_s"])
    meta["plain BlockManager"] = meta["this tree"]
    for peer, (_, m) in peer_recs.items():
        meta[PEER_NAMES[peer]] = m
    return {label: [meta[label]["work"] / t for t in ts] for label, ts in times.items()} | {
        "calls": {label: meta[label]["calls"] for label in times}, "skipped": skipped}


def _ratio_cell(mine: list[float], theirs: list[float]) -> str:
    ratios = [a / b for a, b in zip(mine, theirs, strict=True)]
    return (f"x{statistics.median(mine) / statistics.median(theirs):.2f} "
            f"({min(ratios):.2f}-{max(ratios):.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="150 requests, 1 round")
    parser.add_argument("--baseline", help="a git revision to compare with")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--only", choices=DESIGNS, action="append",
                        help="these designs only (repeatable)")
    parser.add_argument("--no-sweeps", action="store_true", help="the headline only")
    parser.add_argument("--sweeps-only", action="store_true", help="the scaling sweeps only")
    parser.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    n, rounds = (150, 1) if args.quick else (args.requests, args.rounds)
    blocks = 4096
    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() \
        else "?"
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores, load {load}"
          f", python {sys.version.split()[0]}; one process per replay, CPU time of the "
          f"replayed calls less their set-up; {rounds} interleaved rounds")
    print(f"trace: {n} requests, 8 shared 512-token prefixes + 16-128 private tokens, "
          f"16-112 output tokens, n = 1; block_size 16, {blocks:,} blocks, 64 seqs and 4096 "
          f"tokens per step")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        roots = {"this tree": ROOT}
        if args.baseline:
            roots = {args.baseline: extract(args.baseline, tmp / "base"), **roots}
        designs = ("v0",) if args.baseline else tuple(args.only or DESIGNS)
        print("\nheadline: the scheduler's own calls, work (seqs scheduled + freed) per CPU-s; "
              "ratios: median (per-round range)")
        for design in () if args.sweeps_only else designs:
            for caching in (True, False):
                if (design == "radix" or args.baseline is None and design == "v1") \
                        and not caching:
                    continue
                r = compare(roots, design, n, blocks, caching, rounds, tmp, plain=True,
                            peers=() if args.baseline else PEERS[design])
                cells = [f"{label}: {statistics.median(v):,.0f}/s ({r['calls'][label]:,} calls)"
                         for label, v in r.items() if label not in ("calls", "skipped")]
                print(f"  {design:5} caching {'on ' if caching else 'off'}  " + "; ".join(cells))
                mine = r["this tree"]
                if "plain BlockManager" in r:
                    print(f"        twin / plain BlockManager "
                          f"{_ratio_cell(mine, r['plain BlockManager'])}")
                for peer in PEERS[design]:
                    name = PEER_NAMES[peer]
                    if name in r:
                        print(f"        this tree / {name} {_ratio_cell(mine, r[name])}")
                for why in r["skipped"].values():
                    print(f"        {why}")
                if args.baseline:
                    print(f"        this tree / {args.baseline} "
                          f"{_ratio_cell(mine, r[args.baseline])}")
        if args.baseline or args.no_sweeps:
            return
        print(f"\ndecode cost per token by sequence length ({4 if args.quick else 32} "
              f"sequences, 256 tokens each, no scheduler): us per token, the least of "
              f"{rounds} interleaved rounds")
        lengths = (128, 1024, 8192)
        for design in designs:             # interleaved rounds; the least disturbed of each
            runs = [[run_worker(ROOT, "decode", design, str(length),
                                "4" if args.quick else "32")["us"] for length in lengths]
                    for _ in range(rounds)]
            us = {length: min(r[i] for r in runs) for i, length in enumerate(lengths)}
            print(f"  {design:5} " + "  ".join(f"{k:>5}: {v:5.2f}" for k, v in us.items())
                  + f"  (8192 / 128: x{us[8192] / us[128]:.2f})")
        sizes = (1_000, 10_000, 100_000) + (() if args.quick else (1_000_000,))
        sweep_n = 60 if args.quick else 300
        print(f"\npool size sweep (scheduler path, caching on, 16 seqs per step so that 1k "
              f"blocks hold them, {sweep_n} requests): us per unit of work, the least of "
              f"{rounds} rounds")
        for design in designs:
            cells, base = [], None
            for size in sizes:
                r = compare({"this tree": ROOT}, design, sweep_n, size, True, rounds, tmp,
                            max_num_seqs=16)["this tree"]
                us = 1e6 / max(r)                  # the least disturbed round
                base = base or us
                cells.append(f"{size:>9,}: {us:5.2f} ({us / base:.2f}x)")
            print(f"  {design:5} " + "  ".join(cells))


if __name__ == "__main__":
    main()

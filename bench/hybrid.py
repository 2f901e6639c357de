"""Hybrid models' KV cache (issue 33, chapter 14): what the windows save, and what the
coordinator costs.

1. **Capacity** (``course_lib.sizing.hybrid.hybrid_capacity``, vLLM 0.33.0's arithmetic): for
   each hybrid preset with its real config, a 40 GiB KV budget (TP=1) and contexts of 4K, 32K
   and 128K tokens: the pool's blocks, the blocks one request of that length may hold (vLLM's
   ``max_memory_usage_bytes``, window plus tokens in flight for a windowed group), maximum
   concurrency, against the same model with every layer full attention.
2. **The manager on a trace** (the real ``KVCacheManager``, driven as ``SchedulerV1`` drives
   it: a prefix lookup, ``allocate_slots`` for the prompt in chunks, one token per decode
   step, ``free`` at the end): the same requests through one full-attention group and through
   gpt-oss's two groups (full + a 128-token window) and Gemma 3's seven (6 windowed of 1,024 +
   1 full, one layer each here: the manager's work depends on the groups, not the layers);
   microseconds per ``allocate_slots`` (median of interleaved rounds, its range) and the ratio
   to one group (and per group), and the most blocks held at once beside the same groups with
   every layer full attention. Prefix caching on, 32 requests live.
3. **vLLM 0.33.0's own manager** on the same trace and calls (when its sources are in the
   fidelity cache): the same ratios, to tell the course's cost of more groups from the
   design's.

    python bench/hybrid.py            # 400 requests, 5 rounds
    python bench/hybrid.py --quick    # 40 requests, 1 round (a smoke run)
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from course_lib.device import describe  # noqa: E402
from course_lib.memory.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from course_lib.memory.v1.kv_cache_manager import KVCacheManager  # noqa: E402
from course_lib.sizing.hybrid import hybrid_capacity  # noqa: E402
from course_lib.sizing.models import HYBRID_PRESETS  # noqa: E402
from course_lib.sizing.units import GiB  # noqa: E402

BLOCK = 16
CONTEXTS = (4_096, 32_768, 131_072)


def section_capacity() -> None:
    print(f"\n1. Capacity: a 40 GiB KV budget, TP=1, block {BLOCK}; max concurrency = pool "
          f"blocks / blocks one request may hold")
    print(f"  {'model':20} {'context':>8} {'pool blocks':>12} {'blocks/req':>11} "
          f"{'concurrency':>12} {'all-full':>9} {'gain':>6}")
    for spec in HYBRID_PRESETS.values():
        for ctx in CONTEXTS:
            c = hybrid_capacity(spec, 40 * GiB, ctx, block_size=BLOCK)
            print(f"  {spec.name:20} {ctx:>8,} {c.num_blocks:>12,} {c.blocks_per_request:>11,} "
                  f"{c.max_concurrency:>12.2f} {c.all_full_max_concurrency:>9.2f} "
                  f"{c.gain:>5.2f}x")


def groups_of(kind: str, windows: bool = True) -> list[KVCacheGroupSpec]:
    """The groups of each manager the trace runs through; ``windows=False``: the same groups,
    every one full attention (the all-full model with the same pages per block)."""
    def group(name: str, window: int | None) -> KVCacheGroupSpec:
        spec = SlidingWindowSpec(BLOCK, sliding_window=window) if window and windows \
            else FullAttentionSpec(BLOCK)
        return KVCacheGroupSpec((name,), spec)
    if kind == "one group":
        return [group("full", None)]
    if kind == "gpt-oss (2 groups)":
        return [group("swa", 128), group("full", None)]
    return [group(f"swa{i}", 1024) for i in range(6)] + [group("full", None)]


KINDS = ("one group", "gpt-oss (2 groups)", "gemma-3 (7 groups)")


def make_trace(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """n requests: one of 8 shared 512-token prefixes + 32-2,048 own tokens, 16-256 outputs."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 30_000) for _ in range(512)] for _ in range(8)]
    return [(rng.choice(prefixes) + [rng.randrange(1, 30_000) for _ in range(
        rng.randrange(32, 2049))], rng.randrange(16, 257)) for _ in range(n)]


def run_trace(kind: str, trace: list[tuple[list[int], int]], windows: bool = True,
              live: int = 32, chunk: int = 512) -> tuple[float, int, int]:
    """The trace through a fresh manager as SchedulerV1 drives it: (seconds spent in
    allocate_slots, its calls, the most blocks held at once)."""
    num_blocks = 65_536
    kvm = KVCacheManager(BLOCK, num_blocks, enable_caching=True,
                         kv_cache_groups=groups_of(kind, windows))
    waiting = list(enumerate(trace))
    running: dict[int, list] = {}            # seq -> [tokens, computed, outputs left]
    spent, calls, peak = 0.0, 0, 0
    clock = time.perf_counter
    while waiting or running:
        while waiting and len(running) < live:
            seq, (prompt, outputs) = waiting.pop(0)
            hit, num_hit = kvm.get_computed_blocks(seq, prompt)
            tokens = list(prompt)
            first = min(chunk, len(tokens) - num_hit)
            t = clock()
            ids = kvm.allocate_slots(seq, tokens, 0, first, hit, admission=True)
            spent, calls = spent + clock() - t, calls + 1
            assert ids is not None, "the pool is sized for the trace"
            running[seq] = [tokens, num_hit + first, outputs]
        for seq in list(running):
            tokens, computed, left = running[seq]
            if computed < len(tokens):           # the prompt's next chunk
                n = min(chunk, len(tokens) - computed)
            else:                                # a decode step: the token sampled joins
                if left == 0:
                    kvm.free(seq)
                    kvm.forget(seq)
                    del running[seq]
                    continue
                tokens.append(seq % 30_000 + 1)
                running[seq][2] = left - 1
                n = 1
            t = clock()
            ids = kvm.allocate_slots(seq, tokens, computed, n)
            spent, calls = spent + clock() - t, calls + 1
            assert ids is not None, "the pool is sized for the trace"
            running[seq][1] = computed + n
        peak = max(peak, num_blocks - kvm.num_free_gpu_blocks)
    kvm.check_invariants()
    return spent, calls, peak


def run_trace_vllm(kind: str, trace: list[tuple[list[int], int]], vllm,
                   live: int = 32, chunk: int = 512) -> tuple[float, int]:
    """The same trace, driven the same way, through vLLM 0.33.0's own ``KVCacheManager``
    (unitary or hybrid coordinator, imported from the released sources by
    ``tests/fidelity/upstream.py``): (seconds in ``allocate_slots`` and in the request's
    hashing of each new token, which the course does inside ``allocate_slots``; its calls)."""
    from peers import _vllm_request

    utils, iface = vllm.kv_cache_utils, vllm.kv_cache_interface
    hash_fn = vllm.hashing.get_hash_fn_by_name("sha256")
    utils.init_none_hash(hash_fn)
    hasher = utils.get_request_block_hasher(BLOCK, hash_fn)
    shape = {"block_size": BLOCK, "num_kv_heads": 1, "head_size": 1, "dtype": "float32"}
    groups = [iface.KVCacheGroupSpec(
        list(g.layer_names),
        iface.SlidingWindowSpec(**shape, sliding_window=g.kv_cache_spec.sliding_window)
        if isinstance(g.kv_cache_spec, SlidingWindowSpec) else iface.FullAttentionSpec(**shape))
        for g in groups_of(kind)]
    m = vllm.kv_cache_manager.KVCacheManager(
        iface.KVCacheConfig(num_blocks=65_537, kv_cache_tensors=[], kv_cache_groups=groups),
        max_model_len=1 << 20, scheduler_block_size=BLOCK, hash_block_size=BLOCK,
        enable_caching=True, log_stats=False)
    status = vllm.kv_cache_manager.RequestStatus
    waiting = list(enumerate(trace))
    running: dict[int, list] = {}            # seq -> [request, computed, outputs left]
    spent, calls = 0.0, 0
    clock = time.perf_counter
    while waiting or running:
        while waiting and len(running) < live:
            seq, (prompt, outputs) = waiting.pop(0)
            req = _vllm_request(str(seq), list(prompt), hasher, status.WAITING)
            blocks, num_hit, _ = m.get_computed_blocks(req)
            first = min(chunk, len(prompt) - num_hit)
            t = clock()
            out = m.allocate_slots(req, first, num_hit, blocks)
            spent, calls = spent + clock() - t, calls + 1
            assert out is not None, "the pool is sized for the trace"
            req.status = status.RUNNING
            running[seq] = [req, num_hit + first, outputs]
        for seq in list(running):
            req, computed, left = running[seq]
            req.num_computed_tokens = computed
            t = clock()
            if computed < req.num_tokens:        # the prompt's next chunk
                n = min(chunk, req.num_tokens - computed)
            else:                                # a decode step: the token sampled joins
                if left == 0:
                    m.free(req)                  # (not timed, as in run_trace)
                    del running[seq]
                    continue
                req.append_output_token_ids(seq % 30_000 + 1)
                running[seq][2] = left - 1
                n = 1
            out = m.allocate_slots(req, n)
            spent, calls = spent + clock() - t, calls + 1
            assert out is not None, "the pool is sized for the trace"
            running[seq][1] = computed + n
    return spent, calls


def section_vllm(n: int, rounds: int) -> None:
    """Section 3: vLLM 0.33.0's own manager on the same trace, when its sources are in the
    fidelity cache (``make test-fidelity`` or ``python tests/fidelity/fetch.py`` fetches
    them): is the cost of more groups the course's, or the design's?"""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from peers import _fidelity

    upstream, root = _fidelity("vllm-0.33.0")
    if upstream is None:
        print(f"\n3. vLLM 0.33.0's own KVCacheManager: {root}")
        return
    vllm = upstream.load_vllm(root)
    trace = make_trace(n)
    print(f"\n3. vLLM 0.33.0's own KVCacheManager on the same trace and calls (its block "
          f"hashing per new token counted, as the course's allocate_slots does it); "
          f"{rounds} interleaved round(s)")
    per_call: dict[str, list[float]] = {k: [] for k in KINDS}
    for _ in range(rounds):
        for kind in KINDS:
            spent, calls = run_trace_vllm(kind, trace, vllm)
            per_call[kind].append(spent / calls * 1e6)
    base = statistics.median(per_call["one group"])
    print(f"  {'manager':20} {'allocate_slots':>15} {'range':>15} {'x one group':>12} "
          f"{'per group':>10}")
    for kind in KINDS:
        us = per_call[kind]
        med = statistics.median(us)
        print(f"  {kind:20} {med:>12.2f} us {min(us):>6.2f}-{max(us):<6.2f} "
              f"{med / base:>11.2f}x {med / base / len(groups_of(kind)):>9.2f}x")


def section_manager(n: int, rounds: int) -> None:
    trace = make_trace(n)
    print(f"\n2. The manager on a trace: {n} requests (8 shared 512-token prefixes + 32-2,048 "
          f"own tokens, 16-256 outputs), 32 live, prompt chunks of 512, block {BLOCK}, "
          f"prefix caching on; {rounds} interleaved round(s)")
    per_call: dict[str, list[float]] = {k: [] for k in KINDS}
    peaks, calls = {}, {}
    for _ in range(rounds):
        for kind in KINDS:
            spent, calls[kind], peaks[kind] = run_trace(kind, trace)
            per_call[kind].append(spent / calls[kind] * 1e6)
    full_peaks = {kind: run_trace(kind, trace, windows=False)[2] for kind in KINDS}
    base = statistics.median(per_call["one group"])
    print(f"  {'manager':20} {'allocate_slots':>15} {'range':>15} {'x one group':>12} "
          f"{'per group':>10} {'calls':>8} {'peak blocks':>12} {'all-full':>9}")
    for kind in KINDS:
        us = per_call[kind]
        med = statistics.median(us)
        num_groups = len(groups_of(kind))
        print(f"  {kind:20} {med:>12.2f} us {min(us):>6.2f}-{max(us):<6.2f} "
              f"{med / base:>11.2f}x {med / base / num_groups:>9.2f}x {calls[kind]:>8,} "
              f"{peaks[kind]:>12,} {full_peaks[kind]:>9,}")
    print("  (per group: the ratio over the number of groups, each of which allocates; peak "
          "blocks: the most held at once over every group, beside the same groups all full "
          "attention)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="40 requests, 1 round")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    n, rounds = (40, 1) if args.quick else (args.requests, args.rounds)
    print(f"bench/hybrid.py on {describe()}")
    section_capacity()
    section_manager(n, rounds)
    section_vllm(n, rounds)


if __name__ == "__main__":
    main()

"""Block-manager throughput: operations per CPU-second on a synthetic serving trace.

The trace: 2,000 requests whose prompts start with one of a few shared 512-token system
prompts (prefix caching on, so those blocks are hits), then a private suffix; 64 requests
live at once, each decoding 16-112 tokens one ``append_slots`` call at a time, then freed.
An *operation* is one allocate, append_slots or free call. A second table repeats the run
with GPU pools from 1k to 1M blocks: paging's operations are O(1), so the cost per operation
should stay flat.

    python bench/block_manager.py            # full run (about a minute on 2 cores)
    python bench/block_manager.py --quick    # smaller trace, for a smoke test
"""

from __future__ import annotations

import argparse
import gc
import platform
import random
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from course_lib.memory import AllocStatus, BlockManager  # noqa: E402


def make_trace(num_requests: int, seed: int = 0, num_prefixes: int = 4, prefix_len: int = 512):
    """[(prompt token ids, decode length)]: shared prefix + 16..128 private tokens."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(32000) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    trace = []
    for _ in range(num_requests):
        suffix = [rng.randrange(32000) for _ in range(rng.randint(16, 128))]
        trace.append((rng.choice(prefixes) + suffix, rng.randint(16, 112)))
    return trace


def run(trace, num_gpu_blocks: int, max_live: int = 64, block_size: int = 16,
        caching: bool = True) -> dict:
    """Replay the trace; returns op counts and CPU seconds spent inside the manager's calls."""
    m = BlockManager(block_size, num_gpu_blocks, enable_prefix_caching=caching, watermark=0.0)
    # Like vLLM after start-up, move long-lived objects out of the cyclic GC's sight, so that
    # collections triggered by the trace don't rescan a pool-sized free list each time.
    gc.collect()
    gc.freeze()
    waiting = deque(enumerate(trace))
    live: dict[int, list] = {}        # seq_id -> [tokens left to decode, next token]
    ops = {"allocate": 0, "append": 0, "free": 0}
    alloc, append, free = m.allocate, m.append_slots, m.free
    clock = time.process_time
    spent = 0.0
    while waiting or live:
        t0 = clock()
        while waiting and len(live) < max_live and m.can_allocate(len(waiting[0][1][0])) \
                is AllocStatus.OK:
            seq_id, (prompt, out_len) = waiting.popleft()
            alloc(seq_id, prompt)
            m.mark_blocks_as_computed(seq_id, len(prompt))
            live[seq_id] = [out_len, seq_id]
            ops["allocate"] += 1
        for seq_id in list(live):
            state = live[seq_id]
            if not m.can_append_slots(seq_id):       # out of blocks: preempt by recompute
                free(seq_id)
                ops["free"] += 1
                del live[seq_id]
                waiting.appendleft((seq_id, trace[seq_id]))
                continue
            append(seq_id, (state[1],))
            state[1] += 1
            state[0] -= 1
            ops["append"] += 1
            if state[0] == 0:
                free(seq_id)
                ops["free"] += 1
                del live[seq_id]
        spent += clock() - t0
    gc.unfreeze()
    m.check_invariants()
    assert m.num_free_gpu_blocks == num_gpu_blocks
    total = sum(ops.values())
    return {**ops, "total": total, "cpu_s": spent, "ops_per_s": total / spent,
            "us_per_op": 1e6 * spent / total, "hit_rate": m.prefix_cache_stats.hit_rate}


def cpu_name() -> str:
    """The CPU model, so printed figures say what they were measured on."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="200 requests instead of 2,000")
    args = parser.parse_args()
    n = 200 if args.quick else 2000
    trace = make_trace(n)
    print(f"trace: {n} requests, 4 shared 512-token prefixes, block_size 16, 64 live, "
          f"16-112 decode tokens")
    print(f"machine: {cpu_name()}, python {sys.version.split()[0]}, one thread, CPU time")
    for caching in (True, False):
        r = run(trace, num_gpu_blocks=8192, caching=caching)
        print(f"prefix caching {'on ' if caching else 'off'}: {r['total']:,} ops "
              f"(allocate {r['allocate']:,}, append {r['append']:,}, free {r['free']:,}) in "
              f"{r['cpu_s']:.3f} CPU-s = {r['ops_per_s']:,.0f} ops/CPU-s, "
              f"{r['us_per_op']:.2f} us/op, prefix hit rate {r['hit_rate']:.1%}")
    print("\npool size sweep (prefix caching on):")
    print(f"{'num_gpu_blocks':>15} {'ops/CPU-s':>12} {'us/op':>8} {'vs 1k':>7}")
    base = None
    for num_blocks in (1_000, 10_000, 100_000, 1_000_000):
        best = min((run(trace, num_blocks) for _ in range(3)), key=lambda r: r["us_per_op"])
        base = base or best["us_per_op"]
        print(f"{num_blocks:>15,} {best['ops_per_s']:>12,.0f} {best['us_per_op']:>8.2f} "
              f"{best['us_per_op'] / base:>6.2f}x")


if __name__ == "__main__":
    main()

"""Three prefix caches on the same traces: vLLM V0's verified hash chain (the course's
``BlockManager``), vLLM V1's trusted sha256 chain (``KVCacheManager``) and SGLang's radix tree
(``RadixCache``, page size 1 and 16). Printed, never asserted.

Each trace's prompts are served one after another through a KV cache of 8,192 token slots
(512 blocks of 16): a request looks its prompt up, gets slots for the rest, has its prompt
entered in the cache, and is done (its blocks or slots stay cached until evicted). Printed per
trace and system: the share of prompt tokens found in the cache, the CPU time per request
(lookup + allocation + caching + free, the way each system's scheduler calls it), and the
bytes of Python metadata the cache holds per cached token (the hash maps with their keys and
cached blocks' objects; the radix tree's nodes with their token runs and slot lists: one
Python int per token there, where SGLang keeps an int64 tensor).

Traces: a shared system prompt (few-shot), multi-turn chat (each turn's prompt holds the whole
conversation), ShareGPT-like (nothing shared), and RAG-like (eight 512-token documents, each
query one of them plus a question).

    python bench/prefix_caches.py            # about a minute on 2 cores
    python bench/prefix_caches.py --quick    # fewer requests, for a smoke test
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from course_lib.memory import BlockManager, KVCacheManager  # noqa: E402
from course_lib.memory.radix_cache import RadixCache  # noqa: E402
from course_lib.sim.traces import few_shot, multi_turn_chat, sharegpt_like  # noqa: E402

SLOTS, BLOCK = 8192, 16


def deep_sizeof(root) -> int:
    """Bytes of Python objects reachable from ``root`` (each counted once)."""
    seen, todo, total = set(), [root], 0
    while todo:
        obj = todo.pop()
        if id(obj) in seen or obj is None or isinstance(obj, type):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        if isinstance(obj, dict):
            todo += list(obj.keys()) + list(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo += list(obj)
        elif hasattr(obj, "__slots__"):       # links to other nodes are not this one's bytes
            todo += [getattr(obj, s) for s in obj.__slots__ if hasattr(obj, s)
                     and s not in ("prev_free_block", "next_free_block", "parent")]
        elif hasattr(obj, "__dict__") and not callable(obj):
            todo += list(vars(obj).values())
    return total


def rag_like(num: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    docs = [[rng.randrange(32000) for _ in range(512)] for _ in range(8)]
    return [rng.choice(docs) + [rng.randrange(32000) for _ in range(rng.randint(8, 48))]
            for _ in range(num)]


def run_v0(prompts):
    m = BlockManager(BLOCK, SLOTS // BLOCK, watermark=0.0, enable_prefix_caching=True)
    hits = 0
    t0 = time.process_time()
    for i, p in enumerate(prompts):
        m.can_allocate(p)
        hits += m.allocate(i, p)
        m.mark_blocks_as_computed(i, len(p))
        m.free(i)
    cpu = time.process_time() - t0
    cached = len(m.cache.cached_block_ids()) * BLOCK
    return hits, cpu, deep_sizeof(m.cache) / max(1, cached)


def run_v1(prompts):
    m = KVCacheManager(BLOCK, SLOTS // BLOCK, enable_caching=True)
    hits = 0
    t0 = time.process_time()
    for i, p in enumerate(prompts):
        blocks, n = m.get_computed_blocks(i, p)
        m.allocate_slots(i, p, 0, len(p) - n, blocks, admission=True)
        m.record_prefix_cache_stats(len(p), n)
        hits += n
        m.forget(i)
    cpu = time.process_time() - t0
    pool = m.block_pool
    cached = sum(len(b) for b in pool.cached_block_hash_to_block.values()) * BLOCK
    return hits, cpu, deep_sizeof(pool.cached_block_hash_to_block) / max(1, cached)


def run_radix(prompts, page_size):
    cache = RadixCache(SLOTS, page_size)
    hits = 0
    t0 = time.process_time()
    for p in prompts:
        value, node = cache.match_prefix(p)
        cache.inc_lock_ref(node)
        slots = value + cache.alloc(len(p) - len(value))
        done = cache.insert(p, slots)
        cache.pool.free(slots[len(value):done])
        n = len(p) - len(p) % page_size
        cache.pool.free(slots[n:])
        cache.dec_lock_ref(node)
        hits += len(value)
    cpu = time.process_time() - t0
    return hits, cpu, deep_sizeof(cache.root) / max(1, cache.total_size())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    n = 60 if args.quick else 400
    traces = {
        "shared system prompt": [list(t.prompt_token_ids) for t in few_shot(n, seed=0)],
        "multi-turn chat": [list(t.prompt_token_ids)
                            for t in multi_turn_chat(max(2, n // 8), 8, seed=0)],
        "ShareGPT-like": [list(t.prompt_token_ids) for t in sharegpt_like(n, seed=0)],
        "RAG-like": rag_like(n),
    }
    systems = {"vLLM V0 (verified chain)": run_v0, "vLLM V1 (sha256 chain)": run_v1,
               "SGLang radix, page 1": lambda p: run_radix(p, 1),
               "SGLang radix, page 16": lambda p: run_radix(p, 16)}
    print(f"KV cache of {SLOTS:,} token slots (blocks / pages of {BLOCK}); python "
          f"{sys.version.split()[0]}, one thread, CPU time")
    for name, prompts in traces.items():
        total = sum(len(p) for p in prompts)
        print(f"\n{name}: {len(prompts)} prompts, {total:,} tokens")
        print(f"  {'system':26} {'hit tokens':>11} {'us/request':>11} {'B/cached token':>15}")
        for label, run in systems.items():
            hits, cpu, per_token = run(prompts)
            print(f"  {label:26} {hits / total:>10.1%} {1e6 * cpu / len(prompts):>11.1f} "
                  f"{per_token:>15.1f}")


if __name__ == "__main__":
    main()

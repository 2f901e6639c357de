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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from course_lib.sim.prefix_caches import rag_like, serve_radix, serve_v0, serve_v1  # noqa: E402
from course_lib.sim.traces import few_shot, multi_turn_chat, sharegpt_like  # noqa: E402

SYSTEMS = {"vLLM V0 (verified chain)": lambda p: serve_v0(p),
           "vLLM V1 (sha256 chain)": lambda p: serve_v1(p),
           "SGLang radix, page 1": lambda p: serve_radix(p, page_size=1),
           "SGLang radix, page 16": lambda p: serve_radix(p, page_size=16)}


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
    print(f"KV cache of 8,192 token slots (blocks / pages of 16); python "
          f"{sys.version.split()[0]}, one thread, CPU time")
    for name, prompts in traces.items():
        total = sum(len(p) for p in prompts)
        print(f"\n{name}: {len(prompts)} prompts, {total:,} tokens")
        print(f"  {'system':26} {'hit tokens':>11} {'us/request':>11} {'B/cached token':>15}")
        for label, run in SYSTEMS.items():
            hits, cpu, per_token = run(prompts)
            print(f"  {label:26} {hits / total:>10.1%} {1e6 * cpu / len(prompts):>11.1f} "
                  f"{per_token:>15.1f}")


if __name__ == "__main__":
    main()

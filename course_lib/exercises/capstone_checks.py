"""How chapter 11's checkers compare a learner's parts with the library's (see ``ch11``).

:func:`compare_runs` runs every workload of ``ch11.WORKLOADS`` with the learner's append
and/or cache operations plugged into the step loop, and compares it after every step with the
same loop on the library's parts: the tokens generated, the free GPU blocks, the copies the
scheduler asked for, the block manager's invariants. The first difference names the workload,
the step, and the cache operations that step (or the last one that had any) ran.

:func:`order_cases` runs the cache operations on small tagged caches (each block filled with
a number saying which pool, block, layer and tensor it came from) in states where the order of
swap-out, swap-in and copies matters, and names the order a wrong result corresponds to.
"""

from __future__ import annotations

import itertools
import random
import time
from types import SimpleNamespace

import torch

from course_lib.exercises import (
    CASE_SECONDS,
    CHECK_THREADS,
    Budget,
    Verdict,
    judge_cases,
    torch_threads,
)
from course_lib.exercises.solutions import ch11 as solutions
from course_lib.model.tokenizer import ByteTokenizer


class _Diverged(Exception):
    pass


def _ops(out) -> str:
    parts = [f"{name} {pairs}" for name, pairs in (
        ("swapped out (gpu, cpu)", out.blocks_to_swap_out),
        ("swapped in (cpu, gpu)", out.blocks_to_swap_in),
        ("copied (src, dst)", out.blocks_to_copy)) if pairs]
    return ", ".join(parts)


def _describe(i: int, w: tuple) -> str:
    prompts, max_tokens, n, bs, gpu, cpu, mode = w
    return (f"workload {i} ({len(prompts)} prompt(s), n={n}, {gpu} GPU blocks of {bs}, "
            f"{mode} preemption)")


_REFERENCE: dict[tuple[int, int], list[tuple]] = {}
_REFERENCE_CPU: dict[tuple[int, int], float] = {}   # CPU seconds the library's run took
BUDGET_FACTOR = 20   # a learner's run of a workload may take this x the library's CPU time


def _trace(model, i: int, ch11) -> list[tuple]:
    """Per step of the library's run of workload ``i``: (outputs, free GPU blocks, out).
    Its CPU time (one thread, as the learner's run gets) is kept in ``_REFERENCE_CPU``."""
    key = (id(model), i)
    if key not in _REFERENCE:
        w, tok, steps, outs = ch11.WORKLOADS[i], ByteTokenizer(), [], []

        def record(eng, out):
            outs.append(out)
            ch11.library_cache_ops(eng, out)
        start = time.thread_time()
        with torch_threads(CHECK_THREADS):
            ch11.run_loop(ch11.mini_step, model, [tok.encode(p) for p in w[0]], *w[1:],
                          cache_ops=record,
                          on_step=lambda eng, reqs: steps.append(
                              ([r.outputs() for r in reqs],
                               eng.sched.block_manager.num_free_gpu_blocks, outs[-1])))
        _REFERENCE_CPU[key] = time.thread_time() - start
        _REFERENCE[key] = steps
    return _REFERENCE[key]


def _budget(model, i: int, ch11) -> Budget:
    """How much CPU time a learner's run of workload ``i`` may take: scaled from the library's
    own run of it on this machine (computed here, before the learner's clock starts), so a
    slow machine gives a longer limit and a loaded one does not count (CPU time)."""
    _trace(model, i, ch11)
    ref = _REFERENCE_CPU[id(model), i]
    return Budget(max(CASE_SECONDS, BUDGET_FACTOR * ref),
                  f"{BUDGET_FACTOR} x the {ref:.2f} s of CPU time the library's own parts "
                  f"took on this workload on this machine, and at least {CASE_SECONDS:g} s")


def _first_token_difference(got: list, want: list) -> str:
    for r, (g_req, w_req) in enumerate(zip(got, want, strict=True)):
        for s, (g, w) in enumerate(zip(g_req, w_req, strict=False)):
            for j, (a, b) in enumerate(zip(g, w, strict=False)):
                if a != b:
                    return f"request {r}, sample {s}: token {j} is {a} with yours, {b} with " \
                           "the library's"
            if len(g) != len(w):
                return f"request {r}, sample {s}: {len(g)} tokens with yours, {len(w)} " \
                       "with the library's"
        if len(g_req) != len(w_req):
            return f"request {r}: {len(g_req)} samples with yours, {len(w_req)} with the " \
                   "library's"
    return "the tokens differ"


def _append_rule(bm, seq_id: int, token_ids: list[int], append, step: int) -> list:
    """``append(bm, seq_id, token_ids)``, held to 11.1's rules on this one call: a partial
    shared last block is replaced by a fresh one and reported, one reference to it dropped;
    no other block is copied; fresh blocks until every token has a slot; ``token_ids``
    extended. A broken rule raises :class:`_Diverged` naming it in the statement's words, at
    the append that broke it (the engine's tokens would differ only steps later)."""
    table = bm.get_table(seq_id)
    bs, n, new = bm.block_size, len(table.token_ids), len(token_ids)
    last = table.blocks[-1] if table.blocks else None
    refs = bm.gpu.ref_counts[last] if last is not None else 0
    partial, shared, before = n % bs != 0, refs > 1, len(table.blocks)
    copies = append(bm, seq_id, token_ids)
    what = (f"step {step}: appending {new} token(s) to sequence {seq_id} ({n} tokens, its last "
            f"block {last} {'partial' if partial else 'full'}, held by {refs} table(s))")
    now = table.blocks[before - 1] if 0 < before <= len(table.blocks) else None
    if partial and shared:
        if not copies or now == last:
            rule = ("a partial shared last block is replaced by a fresh one and (b, new) "
                    "reported (copy-on-write): else this sequence writes into a block "
                    f"{refs - 1} other table(s) still read")
        elif bm.gpu.ref_counts[last] != refs - 1:
            rule = (f"drop one reference to the old block (bm.gpu.release([b])): block {last} "
                    f"keeps {bm.gpu.ref_counts[last]} reference(s), but {refs - 1} table(s) "
                    "still hold it")
        else:
            rule = None
    elif copies:
        rule = ("only a partial last block is copied; a full one is not: the new token goes "
                "into a fresh block" if not partial else
                "only a shared last block is copied (ref count > 1): this one is the "
                "sequence's own")
    else:
        rule = None
    if rule is None and len(table.blocks) != -(-(n + new) // bs):
        rule = (f"fresh blocks are taken until every new token has a slot: {n + new} tokens "
                f"in blocks of {bs} take {-(-(n + new) // bs)}, the table has "
                f"{len(table.blocks)}")
    if rule is None and len(table.token_ids) != n + new:
        rule = (f"table.token_ids is extended with the new tokens: it holds "
                f"{len(table.token_ids)}, should hold {n + new}")
    if rule is not None:
        raise _Diverged(f"{what}: the rule broken: {rule}")
    return copies


def _run_one(model, i: int, append, cache_ops, ch11) -> None:
    """Workload ``i`` with the learner's parts; raises at the first difference."""
    w, want, outs = ch11.WORKLOADS[i], _trace(model, i, ch11), []
    if append is not None:
        learner_append = append

        def append(bm, seq_id, token_ids):
            return _append_rule(bm, seq_id, token_ids, learner_append, len(outs))

    def ops(eng, out):
        outs.append(out)
        (cache_ops or ch11.library_cache_ops)(eng, out)

    def compare(eng, reqs):
        k, bm = len(outs) - 1, eng.sched.block_manager
        if append is not None:
            try:
                bm.check_invariants()
            except AssertionError as exc:
                raise _Diverged(f"step {k}: the block manager's invariants fail after it "
                                f"({exc}): a block's reference count is the number of tables "
                                "that hold it, and every block is held or free") from exc
        if k >= len(want):
            raise _Diverged(f"step {k}: still running, the library's run ended at step "
                            f"{len(want) - 1}")
        w_out, w_free, w_sched = want[k]
        g_sched = outs[k]
        if g_sched.blocks_to_copy != w_sched.blocks_to_copy:
            raise _Diverged(f"step {k}: the scheduler was told to copy (src, dst) "
                            f"{g_sched.blocks_to_copy} with yours, {w_sched.blocks_to_copy} "
                            "with the library's")
        if bm.num_free_gpu_blocks != w_free:
            raise _Diverged(f"step {k}: {bm.num_free_gpu_blocks} GPU blocks free after it "
                            f"with yours, {w_free} with the library's")
        got = [r.outputs() for r in reqs]
        if got != w_out:
            here = _ops(g_sched)
            last = next((f"; the last step with cache operations, step {j}, {_ops(o)}"
                         for j, o in reversed(list(enumerate(outs[:k]))) if _ops(o)), "")
            raise _Diverged(f"step {k}: {_first_token_difference(got, w_out)}"
                            + (f"; this step {here}" if here else last))

    try:
        ch11.run_loop(ch11.mini_step, model, [ByteTokenizer().encode(p) for p in w[0]],
                      *w[1:], append=append, cache_ops=ops, on_step=compare)
    except (NotImplementedError, _Diverged):
        raise
    except Exception as exc:   # a learner's bug, or an invariant it broke
        raise _Diverged(f"step {len(outs) - 1}: {type(exc).__name__}: {exc}") from exc


def compare_runs(name: str, model, ch11, append=None, cache_ops=None) -> Verdict:
    """Every workload with the learner's parts, step by step against the library's.
    ``ch11``: the chapter module (its workloads and engine pieces; passed in, not imported,
    since the chapter module imports this one)."""
    def judge(parts: tuple, i: int) -> str | None:
        try:
            _run_one(model, i, *parts, ch11)
        except _Diverged as d:
            return f"{_describe(i, ch11.WORKLOADS[i])}, {d}"
        return None

    return judge_cases(name, (append, cache_ops), range(len(ch11.WORKLOADS)), judge,
                       lambda i: _describe(i, ch11.WORKLOADS[i]),
                       seconds=lambda i: _budget(model, i, ch11))


# ---------------------------------------------------------------- the order of cache ops
_LAYERS, _BLOCKS = 2, 6


def _tagged(device_offset: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    caches = []
    for layer in range(_LAYERS):
        pair = []
        for kv in range(2):
            t = torch.empty(_BLOCKS, 2, 1, 3)
            for b in range(_BLOCKS):
                t[b] = 1000 * layer + 100 * kv + device_offset + b
            pair.append(t)
        caches.append(tuple(pair))
    return caches


def _origin(value: float) -> str:
    v = int(value)
    pool = "GPU" if v % 100 < 50 else "CPU"
    return f"{pool} block {v % 50}'s old contents"


def _order_cases() -> list[tuple[list, list, list]]:
    cases = [([], [], []), ([(1, 0)], [], []), ([], [(2, 3)], []), ([], [], [(0, 4), (0, 5)]),
             ([(2, 0)], [(1, 2)], []),               # swap-in reuses the block swap-out empties
             ([], [(3, 1)], [(1, 4)]),               # a copy reads a block just swapped in
             ([(3, 2)], [], [(0, 3)]),               # a copy writes a block just swapped out
             ([(0, 0), (4, 1)], [(5, 0), (2, 4)], [(4, 5)])]
    rng = random.Random(11)
    for _ in range(4):
        gpu = rng.sample(range(_BLOCKS), 5)
        cpu = rng.sample(range(_BLOCKS), 4)
        cases.append(([(gpu[0], cpu[0]), (gpu[1], cpu[1])], [(cpu[2], gpu[0])],
                      [(gpu[2], gpu[3]), (gpu[4], gpu[1])]))
    return cases


def _run(fn, case) -> SimpleNamespace:
    eng = SimpleNamespace(gpu_caches=_tagged(0), cpu_caches=_tagged(50))
    out = SimpleNamespace(blocks_to_swap_out=list(case[0]), blocks_to_swap_in=list(case[1]),
                          blocks_to_copy=list(case[2]), scheduled=[])
    fn(eng, out)
    return eng


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for pa, pb in zip(a.gpu_caches + a.cpu_caches,
                                                  b.gpu_caches + b.cpu_caches, strict=True)
               for x, y in zip(pa, pb, strict=True))


def _in_order(order: tuple[str, ...]):
    def ops(eng, out):
        for op in order:
            solutions.cache_ops(eng, SimpleNamespace(**{
                k: (getattr(out, k) if k == op else []) for k in
                ("blocks_to_swap_out", "blocks_to_swap_in", "blocks_to_copy")}))
    return ops


_NAMES = {"blocks_to_swap_out": "swap-out", "blocks_to_swap_in": "swap-in",
          "blocks_to_copy": "copies"}


def _explain(got, want, case) -> str:
    where = f"swap out {case[0]}, swap in {case[1]}, copy {case[2]}"
    for pool, g_caches, w_caches in (("GPU", got.gpu_caches, want.gpu_caches),
                                     ("CPU", got.cpu_caches, want.cpu_caches)):
        for layer, (g_pair, w_pair) in enumerate(zip(g_caches, w_caches, strict=True)):
            for kv, g, w in zip(("keys", "values"), g_pair, w_pair, strict=True):
                for b in range(_BLOCKS):
                    if not torch.equal(g[b], w[b]):
                        holds = (_origin(float(g[b].flatten()[0]))
                                 if bool((g[b] == g[b].flatten()[0]).all()) else "a mix")
                        text = (f"{where}: {pool} block {b} (layer {layer}, {kv}) holds "
                                f"{holds}, should hold {_origin(float(w[b].flatten()[0]))}")
                        for order in itertools.permutations(_NAMES):
                            if _same(got, _run(_in_order(order), case)):
                                return text + (" -- what running " + ", then ".join(
                                    _NAMES[o] for o in order) + " gives; the design runs "
                                    "swap-out, then swap-in, then copies")
                        return text
    return f"{where}: the caches differ"


def order_cases(name: str, fn, reference) -> Verdict:
    def judge(learner, case) -> str | None:
        got, want = _run(learner, case), _run(reference, case)
        return None if _same(got, want) else _explain(got, want, case)

    return judge_cases(name, fn, _order_cases(), judge,
                       lambda case: f"swap out {case[0]}, swap in {case[1]}, copy {case[2]}")


# ---------------------------------------------------------------- plausible wrong answers
def _append_without_cow(bm, seq_id, token_ids):          # writes into the shared block
    table = bm.get_table(seq_id)
    blocks = table.blocks
    while len(blocks) * bm.block_size < len(table.token_ids) + len(token_ids):
        blocks.append(bm.gpu.allocate())
    table.token_ids.extend(token_ids)
    return []


def _append_keeping_the_old_reference(bm, seq_id, token_ids):   # copies, never releases
    table = bm.get_table(seq_id)
    blocks, n = table.blocks, len(table.token_ids)
    copies = []
    if n % bm.block_size and bm.gpu.ref_counts[blocks[-1]] > 1:
        src, blocks[-1] = blocks[-1], bm.gpu.allocate()
        copies.append((src, blocks[-1]))
    while len(blocks) * bm.block_size < n + len(token_ids):
        blocks.append(bm.gpu.allocate())
    table.token_ids.extend(token_ids)
    return copies


def _append_copying_full_blocks(bm, seq_id, token_ids):  # copies a shared block even if full
    table = bm.get_table(seq_id)
    blocks, n = table.blocks, len(table.token_ids)
    copies = []
    if bm.gpu.ref_counts[blocks[-1]] > 1:
        src, blocks[-1] = blocks[-1], bm.gpu.allocate()
        bm.gpu.release([src])
        copies.append((src, blocks[-1]))
    while len(blocks) * bm.block_size < n + len(token_ids):
        blocks.append(bm.gpu.allocate())
    table.token_ids.extend(token_ids)
    return copies


def _keys_only(eng, out):                                 # forgets the value caches
    for (gk, _), (ck, _) in zip(eng.gpu_caches, eng.cpu_caches, strict=False):
        for gpu, cpu in out.blocks_to_swap_out:
            ck[cpu] = gk[gpu]
        for cpu, gpu in out.blocks_to_swap_in:
            gk[gpu] = ck[cpu]
    for k, _ in eng.gpu_caches:
        for src, dst in out.blocks_to_copy:
            k[dst] = k[src]


WRONG_APPENDS = (_append_without_cow, _append_keeping_the_old_reference,
                 _append_copying_full_blocks)
WRONG_CACHE_OPS = (_in_order(("blocks_to_swap_in", "blocks_to_swap_out", "blocks_to_copy")),
                   _in_order(("blocks_to_copy", "blocks_to_swap_out", "blocks_to_swap_in")),
                   _keys_only)

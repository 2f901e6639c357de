"""Exercises of chapter 08 (capacity planning): the smallest TP size for a load, KV heads per
rank, how many requests of a mix of lengths a pool runs at once (8.3, in ``ch08_requests``).

As in ch01, reference_* is the library's answer (course_lib.capacity) and check_* compares a
learner's function with it on many cases. Some cases have no answer: the library raises
ValueError (no TP size serves the load; a TP size that cannot split the heads). There the
learner's function must raise ValueError too; the checkers compare "raises ValueError" like
a value. ``reference_num_gpu_blocks`` and ``BLOCK_CASES`` are the page's toy budget on the
articles' figures (no longer an exercise: the page computes it), kept for the figures' tests.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from course_lib import capacity as cap
from course_lib.exercises import (
    Exercise,
    Exercises,
    Rule,
    Verdict,
    check,
    judge_cases,
    returns,
    rule_wrongs,
)
from course_lib.exercises.ch08_requests import (
    _average_request,
    _last_token_cached,
    _mix_tokens_not_blocks,
    _reserve_final_size,
    check_max_num_requests,
)
from course_lib.exercises.solutions import ch08 as solutions
from course_lib.sizing.blocks import num_blocks_for_tokens, num_gpu_blocks
from course_lib.sizing.models import ModelSpec
from course_lib.sizing.units import H200_MEMORY_GIB, GiB, cdiv

RAISES = "raises ValueError"

# (total_gpu_memory_gib, gpu_memory_utilization, weight_gib, other_gib, block_bytes)
BLOCK_CASES = [
    (80, 0.9, 17.5, 3.5, 655_360),       # Block Manager tutorial §4.3: 70B, TP=8: 83,558
    (80, 0.9, 16, 0, 2 * 1024 ** 2),     # PagedAttention explained §4.2: 8B, A100: 28,672
    (80, 0.9, 35, 0, 1_310_720),         # 70B at TP=4, one rank
    (80, 1.0, 78.125, 0, 1_179_648),     # DeepSeek-V3 FP8 weights over 8 ranks
    (24, 0.5, 6, 2, 1024 ** 2),          # the budget is exactly 4 GiB: 4,096 blocks
    (24, 0.5, 6, 6, 1024 ** 2),          # a budget of exactly zero: no blocks, no error
    (24, 0.5, 6, 7, 1024 ** 2),          # negative budget: the model does not fit
    (16, 0.75, 15, 0, 1024 ** 2),        # weights exceed usable memory
    (80, 0.9, 16, 0, 3 * 1024 ** 3),     # a block bigger than the budget: zero blocks
    # H200 (nvidia-smi's 140.4 GiB) at vLLM 0.33.0's 0.92: Llama-3-70B over 2 ranks, 2.5 MiB
    # blocks: 25,173
    (H200_MEMORY_GIB, 0.92, 65.71, 2, 2_621_440),
]

# (num_kv_heads, tensor_parallel_size)
HEAD_CASES = [
    (8, 1), (8, 2), (8, 8),      # GQA: heads split evenly
    (8, 16), (8, 64),            # more ranks than KV heads: each rank keeps (a copy of) one
    (32, 4), (4, 2), (4, 8),
    (1, 1), (1, 8),              # MQA
    (8, 3),                      # does not divide: ValueError
    (8, 12), (6, 4), (8, 0),
    (8, -2), (8, -8), (1, -1),   # TP below 1: -2 divides 8, so only "at least 1" refuses it
]

def raises_as_value(fn: Callable[..., Any]) -> Callable[..., Any]:
    """fn, with ValueError turned into the result RAISES (NotImplementedError passes through)."""
    def wrapped(*args: Any) -> Any:
        try:
            return fn(*args)
        except ValueError:
            return RAISES
    return wrapped


def reference_num_gpu_blocks(total_gpu_memory_gib: float, gpu_memory_utilization: float,
                             weight_gib: float, other_gib: float, block_bytes: int) -> int:
    """floor((total x utilization - weights - other) / block_bytes); ValueError if negative.

    GiB arguments become bytes first (x 2**30, rounded), as vLLM counts in bytes.
    """
    avail = cap.available_kv_bytes(round(total_gpu_memory_gib * GiB), gpu_memory_utilization,
                                   round(weight_gib * GiB), round(other_gib * GiB))
    return num_gpu_blocks(avail, block_bytes)


def reference_kv_heads_per_rank(num_kv_heads: int, tensor_parallel_size: int) -> int:
    """KV heads one rank stores: split while tp <= heads, then one (replicated) head per rank.

    tp and num_kv_heads must divide one another, otherwise ValueError.
    """
    spec = ModelSpec("exercise", 1, num_kv_heads * 64, num_kv_heads, 128, num_params=1)
    return cap.kv_heads_per_rank(spec, tensor_parallel_size)


def reference_smallest_tp(num_layers: int, num_attention_heads: int, num_kv_heads: int,
                          head_dim: int, num_params: int, gpu_memory_gib: float,
                          max_model_len: int, num_requests: int) -> int:
    """The smallest tensor-parallel size whose every rank holds ``num_requests`` requests of
    ``max_model_len`` tokens at once: 16-bit weights split evenly over the ranks, 16-bit K/V,
    ``gpu_memory_utilization`` 0.9, blocks of 16 tokens, no activations or overhead. Sizes
    that cannot split the heads are skipped; ValueError when no size works."""
    spec = ModelSpec("exercise", num_layers, num_attention_heads, num_kv_heads, head_dim,
                         num_params=num_params)
    per_request = num_blocks_for_tokens(max_model_len, 16)
    for tp in range(1, num_attention_heads + 1):
        try:
            block = cap.block_bytes(spec, 16, tp)
            avail = cap.available_kv_bytes(round(gpu_memory_gib * GiB), 0.9,
                                           round(spec.weight_bytes / tp))
        except ValueError:                    # cannot split the heads / the weights do not fit
            continue
        if num_gpu_blocks(avail, block) // per_request >= num_requests:
            return tp
    raise ValueError(f"no tensor-parallel size of {spec.num_attention_heads} heads serves "
                     f"{num_requests} requests of {max_model_len} tokens")


_MODELS = {   # (num_layers, num_attention_heads, num_kv_heads, head_dim, num_params)
    "Llama-2-7B": (32, 32, 32, 128, 6_738_415_616),
    "Llama-3-8B": (32, 32, 8, 128, 8_030_261_248),
    "Llama-3-70B": (80, 64, 8, 128, 70_553_706_496),
    "Qwen2.5-7B": (28, 28, 4, 128, 7_615_616_512),
    "24 heads, 6 KV heads": (40, 24, 6, 128, 20_000_000_000),
    "MQA, 1 KV head": (48, 48, 1, 128, 15_000_000_000),
}


def tp_cases(seed: int = 12, count: int = 30) -> list[tuple]:
    llama70, llama8, odd, mqa = (_MODELS[k] for k in ("Llama-3-70B", "Llama-3-8B",
                                                       "24 heads, 6 KV heads", "MQA, 1 KV head"))
    cases = [
        (*llama8, 80, 8192, 1),          # fits one GPU
        (*llama70, 80, 8192, 1),         # 141 GB of weights: 2 ranks at least
        (*llama70, 80, 32_768, 100),     # a load that needs more ranks
        (*llama70, 80, 32_768, 10_000),  # no size serves it: ValueError
        (*odd, 40, 4096, 60),            # 24 query and 6 KV heads: TP 3 and 6 valid, 4 not
        (*odd, 24, 8192, 40),            # TP 6: a power-of-two search misses it
        (*mqa, 80, 4096, 200),           # one KV head: the cache per rank never shrinks
        (*llama8, 24, 8193, 5),          # one token past 8192: 513 blocks a request
        (*llama8, 16, 8192, 1),          # 16 GB of weights on 14.4 usable: TP 2
        (*llama8, 24, 17, 2500),         # 17 tokens take 2 blocks, 32 slots, not 17
        (*_MODELS["Qwen2.5-7B"], 24, 32_768, 43),   # 28 heads: TP 8 splits the KV heads only
    ]
    rng = random.Random(seed)
    names = sorted(_MODELS)
    for _ in range(count):
        cases.append((*_MODELS[rng.choice(names)], rng.choice([24, 40, 48, 80, 141]),
                      rng.choice([2048, 4097, 8192, 32_768, 131_072, 100, 1000]),
                      rng.choice([1, 4, 16, 64, 256, 1024])))
    return cases


def check_smallest_tp(fn: Callable[..., int]) -> Verdict:
    return check("8.1 smallest_tp", raises_as_value(fn), raises_as_value(reference_smallest_tp),
                 tp_cases())


def _kv_heads_rule(num_kv_heads: int, tp: int) -> str:
    """The rule of 8.2's statement that decides ``(num_kv_heads, tp)``, in its words."""
    if tp < 1:
        return f"TP must be at least 1 (a size of {tp} has no rank to hold a head)"
    if num_kv_heads % tp if tp <= num_kv_heads else tp % num_kv_heads:
        return (f"TP and the head count must divide one another ({tp} ranks, "
                f"{num_kv_heads} heads: neither is a multiple of the other)")
    if tp > num_kv_heads:
        return ("with more ranks than heads each rank holds one (replicated) head "
                f"({tp} is a multiple of {num_kv_heads})")
    return "the heads split evenly while there are at least as many heads as ranks"


def _judge_kv_heads(case: tuple[int, int], got: Any) -> str | None:
    want = raises_as_value(reference_kv_heads_per_rank)(*case)
    if got == want and not isinstance(got, bool):
        return None
    should = "raise ValueError" if want == RAISES else f"return {want}"
    did = "raised ValueError" if got == RAISES else f"returned {got!r}"
    return f"{case}: {did}, should {should}: {_kv_heads_rule(*case)}"


def check_kv_heads_per_rank(fn: Callable[[int, int], int]) -> Verdict:
    """8.2: each case against the library; a difference names the rule of the statement
    that decides that case."""
    return judge_cases("8.2 kv_heads_per_rank", raises_as_value(fn), HEAD_CASES,
                       returns(_judge_kv_heads))


def shown_kv_heads_per_rank(num_kv_heads, tensor_parallel_size):
    """8.2's broken function, as the notebook shows it (the learner returns it fixed)."""
    tp = tensor_parallel_size
    if tp > num_kv_heads:
        return 1                                  # more ranks than heads: a copy each
    if num_kv_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} cannot split {num_kv_heads} KV heads")
    return num_kv_heads // tp


# ----------------------------------------------------------------- the registry
def _weights_not_split(L, H, KV, D, P, gib, max_len, n):
    """Wrong: every rank holds all the weights."""
    return _search(L, H, KV, D, P, gib, max_len, n, split_weights=False)


def _powers_of_two(L, H, KV, D, P, gib, max_len, n):
    """Wrong: tries only 1, 2, 4, 8, ... (TP 3 or 6 can be the answer)."""
    return _search(L, H, KV, D, P, gib, max_len, n, sizes=[2 ** k for k in range(8)])


def _tokens_not_blocks(L, H, KV, D, P, gib, max_len, n):
    """Wrong: a request takes max_model_len token slots, not whole blocks."""
    return _search(L, H, KV, D, P, gib, max_len, n, whole_blocks=False)


def _heads_not_checked(L, H, KV, D, P, gib, max_len, n):
    """Wrong: a size need not divide num_attention_heads."""
    return _search(L, H, KV, D, P, gib, max_len, n, heads_divide=False)


def _kv_not_checked(L, H, KV, D, P, gib, max_len, n):
    """Wrong: a size need not divide, or be a multiple of, num_kv_heads."""
    return _search(L, H, KV, D, P, gib, max_len, n, kv_divide=False)


def _never_raises(L, H, KV, D, P, gib, max_len, n):
    """Wrong: returns num_attention_heads when no size works, instead of raising."""
    try:
        return _search(L, H, KV, D, P, gib, max_len, n)
    except ValueError:
        return H


def _search(L, H, KV, D, P, gib, max_len, n, split_weights=True, sizes=None,
            whole_blocks=True, heads_divide=True, kv_divide=True):
    for tp in sizes or range(1, H + 1):
        if tp > H or (heads_divide and H % tp) or (
                kv_divide and (KV % tp if tp <= KV else tp % KV)):
            continue
        block = 16 * L * 2 * max(1, KV // tp) * D * 2
        budget = 0.9 * gib * 2**30 - 2 * P / (tp if split_weights else 1)
        if budget < 0:
            continue
        blocks = budget // block
        fits = blocks // cdiv(max_len, 16) if whole_blocks else blocks * 16 // max_len
        if fits >= n:
            return tp
    raise ValueError("none")


EXERCISES = Exercises(
    Exercise("8.1", "smallest_tp", check_smallest_tp, hints=(
        "Try the sizes in increasing order and return the first that works. Three things "
        "change with tp: which sizes are allowed at all, the weights on a rank, and the K/V "
        "heads a rank caches.",
        "Allowed: tp divides num_attention_heads, and tp and num_kv_heads divide one another. "
        "Per rank: weights 2 x num_params / tp bytes; max(1, num_kv_heads // tp) KV heads; "
        "a budget below 0 means this size does not fit. A request takes "
        "ceil(max_model_len / 16) whole blocks.",
        "Write the test of one size as its own function (allowed? budget? requests that fit?) "
        "and check it by hand on a size that must fail for each reason.",
    ), solution=solutions.smallest_tp, rules=(
        Rule("the weights split evenly over the ranks", "(80, 64, 8, 128, 70553706496, 80, "
             "8192, 1)", _weights_not_split),
        Rule("try the sizes from 1 up (not only powers of two)", "(40, 24, 6, 128, "
             "20000000000, 24, 8192, 40)", _powers_of_two),
        Rule("a request holds whole blocks of 16 tokens", "(32, 32, 8, 128, 8030261248, 24, "
             "17, 2500)", _tokens_not_blocks),
        Rule("num_attention_heads must be a multiple of the size", "(28, 28, 4, 128, "
             "7615616512, 24, 32768, 43)", _heads_not_checked),
        Rule("the size and num_kv_heads divide one another (8.2's rule)", "(40, 24, 6, 128, "
             "20000000000, 24, 8192, 40)", _kv_not_checked),
        Rule("raise ValueError if no size up to num_attention_heads works", "(80, 64, 8, 128, "
             "70553706496, 80, 32768, 10000)", _never_raises),
    ), compare_with="kv_heads_per_rank, block_bytes, available_kv_bytes and plan_kv_cache in "
                    "course_lib/capacity.py"),
    Exercise("8.2", "fix kv_heads_per_rank", check_kv_heads_per_rank, hints=(
        "Run the function above in your head on sizes it was not written for: more ranks "
        "than heads but not a multiple of them (8 heads, 12 ranks), and tp = 0.",
        "Two regimes, one rule between them: the larger of tp and num_kv_heads must be a "
        "multiple of the smaller. And tp < 1 must be refused before anything divides by it.",
    ), solution=solutions.kv_heads_per_rank, wrong=(shown_kv_heads_per_rank,), rules=(
        Rule("with more ranks than heads each rank holds one (replicated) head",
             "(8, 16)",
             lambda h, tp: h // tp),
        Rule("TP and the head count must divide one another, otherwise ValueError",
             "(8, 3)",
             lambda h, tp: max(1, h // tp)),
        Rule("TP must be at least 1, otherwise ValueError",
             "(8, 0)",
             rule_wrongs.kv_heads_no_tp_check),
        Rule("TP must be at least 1, negative sizes too",
             "(8, -2)",
             rule_wrongs.kv_heads_only_zero_refused),
    ), compare_with=(
        "kv_heads_per_rank in course_lib/capacity.py (it also handles MLA)")),
    Exercise("8.3", "max_num_requests for a mix of lengths", check_max_num_requests, hints=(
        "Do not look for a formula: simulate. Keep a list need[s], the blocks the admitted "
        "requests hold in step s, and add the requests one at a time, in order.",
        "Request (p, o) adds cdiv(p + s, block_size) to need[s] for s in range(o), nothing "
        "after (it has left). Stop at the first request that pushes max(need) over "
        "num_gpu_blocks: the answer is the number admitted before it.",
        "cdiv(x, bs) is -(-x // bs).",
    ), solution=solutions.max_num_requests,
        rules=(
        Rule("a request holds the blocks of its tokens so far, growing step by step",
             "pool of 6 bl",
             _reserve_final_size),
        Rule("requests hold whole blocks, not token slots",
             "pool of 231 blocks of 32",
             _mix_tokens_not_blocks),
        Rule("in step s a request holds p + s tokens (the token just sampled has no slot yet)",
             "pool of 1 block of 16, requests (prompt_len, output_len) [(16, 1",
             _last_token_cached),
        Rule("the requests are added one at a time, in order (not an average request)",
             "pool of 6 bl",
             _average_request),
    ),
        compare_with=(
        "max_concurrency in course_lib/capacity.py, vLLM's figure for requests that all reach "
        "max_model_len, and Scheduler.schedule in course_lib/scheduler/scheduler.py, where "
        "append_decode asks for these blocks one step at a time and preempts when they run out")),
)


hint = EXERCISES.print_hint            # ch08.hint("N.M"): the next graded hint
solution = EXERCISES.print_solution    # ch08.solution("N.M"): a solution's code

"""Chapter 04 exercises: the paged gather and the one-head decode loop as Triton kernels, and
the split-K merge of two partial attentions.

Every case (but 4.1's last) is a paged cache whose free blocks, and the slots past the sequence
in its last block, hold NaN; the block table lists the sequence's blocks in a shuffled order and
then ``-1`` entries, as a batch's padded table row does; the cache sits between two guard blocks
of NaN, so a ``-1`` that is followed reads NaN instead of crashing. The checkers run the edge
cases (one token, a full last block, block size 1, a maximum that grows in the last block,
scores too large for ``exp`` without the maximum), then random cases from a fixed seed, and name
the first token (or element) that differs and, where it can tell, the idea that was missed.
4.1 and 4.2 each have a case whose sequence ends at the cache's very last slot (``at_end``), so a
load past a row leaves the cache: the interpreter's spy names it (loads and stores are checked,
see :mod:`course_lib.exercises.launches`), where elsewhere it would read a NaN that a masked store
leaves out. 4.1's last case (:func:`huge_case`) puts a block at ``2**27 + 1`` in a cache of
``2**31`` values (virtual memory), so an int32 page index overflows; 4.3's include log-sum-exps
in the hundreds, past float32's ``exp`` overflow. The answers must be tensors the learner's
kernel wrote (:func:`course_lib.exercises.launches.not_from_kernel`). Under ``torch-reference``
the Triton exercises say they need a Triton backend.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch

from course_lib.device import BACKEND
from course_lib.exercises import Exercise, Exercises, Rule, Verdict, judge_cases, launches
from course_lib.exercises.ch04_wrong import (
    _decode_noop_then_torch,
    _decode_unscaled,
    _decode_with,
    _decode_with_course_kernel,
    _gather_in_torch,
    _gather_int32_page,
    _gather_noop_then_torch,
    _gather_with,
    _merge_average,
    _merge_in_torch,
    _merge_nan_when_both_empty,
    _merge_noop_then_torch,
    _merge_torch_into_kernel_output,
    _merge_without_max,
)
from course_lib.exercises.solutions import ch04 as solutions
from course_lib.kernels import reference
from course_lib.sizing.units import cdiv


def paged_case(seq_len: int, block_size: int, heads: int, head_dim: int, seed: int,
               q_scale: float = 1.0, late_max: bool = False, at_end: bool = False) -> dict:
    """One sequence in a NaN-filled paged cache: ``q [head_dim]``, caches ``[num_blocks,
    block_size, heads, head_dim]`` (views into a buffer with a NaN guard block on each side),
    ``table`` (int32: the blocks in a shuffled order, then two ``-1``) and the contiguous
    ``k, v [seq_len, heads, head_dim]`` they hold.

    ``at_end``: the sequence's last block is the cache's last block, so a load past the
    sequence's last slot leaves the cache (the checker's spy names it; on a GPU the guard
    block keeps it from faulting): a kernel whose loads are not masked passes every other
    case, where such a read lands on a NaN slot the store then leaves out."""
    gen = torch.Generator().manual_seed(seed)
    used = cdiv(seq_len, block_size)
    num_blocks = used + 3
    pages = torch.randperm(num_blocks, generator=gen)[:used]
    if at_end:
        pages[pages == num_blocks - 1] = pages[-1].clone()
        pages[-1] = num_blocks - 1
    k = torch.randn(seq_len, heads, head_dim, generator=gen)
    v = torch.randn(seq_len, heads, head_dim, generator=gen)
    q = torch.randn(head_dim, generator=gen) * q_scale
    if late_max:                       # the last block holds the largest score
        k[(used - 1) * block_size:, 0] += 3 * q / q.norm()
    caches = []
    for src in (k, v):
        buf = torch.full((num_blocks + 2, block_size, heads, head_dim), float("nan"))
        pos = torch.arange(seq_len)
        buf[1 + pages[pos // block_size], pos % block_size] = src
        caches.append(buf.to(BACKEND.device)[1:-1])
    table = torch.cat([pages, torch.tensor([-1, -1])]).to(torch.int32).to(BACKEND.device)
    return dict(seq_len=seq_len, block_size=block_size, heads=heads, head_dim=head_dim,
                q=q.to(BACKEND.device), key_cache=caches[0], value_cache=caches[1],
                table=table, k=k, v=v, q_scale=q_scale, at_end=at_end)


AT_END = "its last slot the cache's last"   # how a case at the end of the cache is told


def _where(c: dict) -> str:
    end = f" ({AT_END})" if c.get("at_end") else ""
    return (f"seq_len={c['seq_len']}, block_size={c['block_size']}, table "
            f"{c['table'].tolist()}{end}")


# ------------------------------------------------------------------ 4.1 the paged gather
def gather_cases() -> list[dict]:
    rng = random.Random(41)
    shapes = [(1, 4, 1, 4), (4, 4, 2, 4), (5, 4, 2, 4), (37, 16, 2, 8), (16, 8, 1, 8),
              (9, 1, 2, 4), (23, 8, 3, 4)]          # 3 x 4 = 12: not a power of two
    shapes += [(rng.randrange(1, 40), 2 ** rng.randrange(0, 5), rng.randrange(1, 3), 4)
               for _ in range(5)]
    cases = [paged_case(*shape, seed=i) for i, shape in enumerate(shapes)]
    cases.append(paged_case(12, 4, 3, 2, seed=len(shapes), at_end=True))   # row 6, padded to 8
    return cases + ([huge_case()] if _room_for_huge_case() else [])


HUGE_PAGE = 2**27 + 1   # x 4 slots x 4 values: element offset 2**31 + ..., past int32


def _room_for_huge_case() -> bool:
    """The 64-bit case needs an 8 GiB cache: virtual memory on a CPU (only the few pages the
    sequence uses are touched), real memory on a GPU (only where 16 GiB are free)."""
    if torch.device(BACKEND.device).type == "cpu":
        return True
    free, _ = torch.cuda.mem_get_info(BACKEND.device)
    return free >= 16 * 2**30


def huge_case() -> dict:
    """A sequence of 5 tokens whose first block is block ``2**27 + 1`` of a cache of
    ``[2**27 + 2, 4, 1, 4]`` float32: its element offset, ``block x 4 x 4``, passes ``2**31``,
    so a page index kept in int32 overflows. Key and value caches are two views of one
    allocation (the value cache starts 8 blocks later; the used blocks do not overlap);
    nothing but the sequence's slots is written, so on a CPU the 8 GiB stay virtual."""
    bs, heads, dim, num_blocks, seq_len = 4, 1, 4, HUGE_PAGE + 1, 5
    gen = torch.Generator().manual_seed(4141)
    storage = torch.empty((num_blocks + 8) * bs * heads * dim, device=BACKEND.device)
    caches = [storage[off * bs * heads * dim:(off + num_blocks) * bs * heads * dim]
              .view(num_blocks, bs, heads, dim) for off in (0, 8)]
    pages = [HUGE_PAGE, 3]
    k = torch.randn(seq_len, heads, dim, generator=gen)
    v = torch.randn(seq_len, heads, dim, generator=gen)
    for cache, src in zip(caches, (k, v), strict=True):
        for p in range(seq_len):
            cache[pages[p // bs], p % bs] = src[p].to(BACKEND.device)
    table = torch.tensor([*pages, -1, -1], dtype=torch.int32, device=BACKEND.device)
    return dict(seq_len=seq_len, block_size=bs, heads=heads, head_dim=dim, q=None,
                key_cache=caches[0], value_cache=caches[1], table=table, k=k, v=v, q_scale=1.0)


def _judge_gather(learner: Callable, c: tuple) -> str | None:
    (c,) = c
    got = learner(c["key_cache"], c["value_cache"], c["table"], c["seq_len"])
    shape = (c["seq_len"], c["heads"], c["head_dim"])
    if not (isinstance(got, (tuple, list)) and len(got) == 2
            and all(isinstance(t, torch.Tensor) and tuple(t.shape) == shape for t in got)):
        return f"{_where(c)}: expected (k, v), two tensors of shape {shape}, got {got!r:.80}"
    for name, t in zip("kv", got, strict=True):
        if problem := launches.not_from_kernel(t, name):
            return f"{_where(c)}: {problem}"
    bs = c["block_size"]
    for name, t, want in (("k", got[0].cpu(), c["k"]), ("v", got[1].cpu(), c["v"])):
        bad = [p for p in range(c["seq_len"]) if not torch.equal(t[p], want[p])]
        if bad:
            p = bad[0]
            entry = int(c["table"][p // bs])
            where = (f"{_where(c)}: {name}[{p}] (logical block {p // bs}, offset {p % bs}, "
                     f"so physical block {entry}, slot {entry * bs + p % bs}) ")
            if t[p].isnan().any():
                return where + "holds NaN: it was read from a slot the sequence does not own"
            return where + f"is {t[p].flatten()[:4].tolist()}..., want " \
                           f"{want[p].flatten()[:4].tolist()}..."
    return None


def check_gather_kv(fn: Callable) -> Verdict:
    """Exercise 4.1: ``gather_kv(key_cache, value_cache, block_table, seq_len) -> (k, v)``,
    each ``[seq_len, num_kv_heads, head_dim]``, read through the block table."""
    return judge_cases("4.1 gather_kv", fn, [(c,) for c in gather_cases()], _judge_gather,
                       lambda c: _where(c[0]), needs_triton=True)


# ------------------------------------------------------------------ 4.2 one-head decode
def decode_cases() -> list[dict]:
    rng = random.Random(42)
    specs = [(1, 4, 4, 1.0, False), (4, 4, 8, 1.0, False), (5, 4, 8, 1.0, True),
             (16, 16, 8, 1.0, False), (40, 16, 8, 1.0, True), (9, 1, 4, 1.0, True),
             (23, 8, 16, 2.0, True), (50, 4, 8, 60.0, False)]    # scores up to ~hundreds
    specs += [(rng.randrange(1, 60), 2 ** rng.randrange(0, 5), 8, 2.0, rng.random() < 0.5)
              for _ in range(6)]
    return [paged_case(n, bs, 1, d, seed=100 + i, q_scale=qs, late_max=late)
            for i, (n, bs, d, qs, late) in enumerate(specs)] + [
        paged_case(12, 4, 1, 8, seed=100 + len(specs), late_max=True, at_end=True)]


def _attend(q, k, v, scale: float) -> torch.Tensor:
    """Attention of one query ``[head_dim]`` over ``k, v [n, head_dim]`` (the specification)."""
    return torch.softmax(k @ q * scale, 0) @ v


def _no_rescale(c: dict) -> torch.Tensor:
    """What the online loop gives when it forgets to rescale the running sums."""
    q, k, v, bs = c["q"].cpu(), c["k"][:, 0], c["v"][:, 0], c["block_size"]
    s = k @ q / math.sqrt(c["head_dim"])
    m, total, acc = float("-inf"), 0.0, torch.zeros(c["head_dim"])
    for lo in range(0, c["seq_len"], bs):
        m = max(m, s[lo:lo + bs].max().item())
        p = torch.exp(s[lo:lo + bs] - m)
        total, acc = total + p.sum().item(), acc + p @ v[lo:lo + bs]
    return acc / total


def _judge_decode(learner: Callable, c: tuple) -> str | None:
    (c,) = c
    got = learner(c["q"], c["key_cache"], c["value_cache"], c["table"], c["seq_len"])
    d = c["head_dim"]
    q, k, v = c["q"].cpu(), c["k"][:, 0], c["v"][:, 0]
    want = _attend(q, k, v, d ** -0.5)
    where = f"{_where(c)}, head_dim={d}"
    if not (isinstance(got, torch.Tensor) and tuple(got.shape) == (d,)):
        return f"{where}: expected a tensor of shape ({d},), got {got!r:.80}"
    if problem := launches.not_from_kernel(got, "out"):
        return f"{where}: {problem}"
    got = got.detach().float().cpu()
    if torch.allclose(got, want, atol=1e-4, rtol=1e-4):
        return None
    if got.isnan().any():
        why = ("the scores reach hundreds here: exp() overflows unless you subtract the "
               "running maximum" if c["q_scale"] > 10 else
               "a slot past seq_len (NaN in the cache) reached the sums: mask the K and V "
               "loads (other=0.0) and set those scores to -inf; 0 x NaN is NaN")
        return f"{where}: the output holds NaN: {why}"
    if torch.allclose(got, _no_rescale(c), atol=1e-4, rtol=1e-4):
        return (f"{where}: this is what the loop gives without rescaling: when a block raises "
                "the maximum from m to m_new, multiply the running sum and acc by "
                "exp(m - m_new)")
    if torch.allclose(got, _attend(q, k, v, 1.0), atol=1e-4, rtol=1e-4):
        return f"{where}: the scores are not scaled by 1/sqrt(head_dim)"
    i = int((got - want).abs().argmax())
    return f"{where}: out[{i}] = {got[i].item():.5f}, the library gives {want[i].item():.5f}"


def check_decode_one_head(fn: Callable) -> Verdict:
    """Exercise 4.2: ``decode_one_head(q, key_cache, value_cache, block_table, seq_len)`` ->
    ``[head_dim]`` float32: one query head's attention over the sequence's cached tokens."""
    return judge_cases("4.2 decode_one_head", fn, [(c,) for c in decode_cases()],
                       _judge_decode, lambda c: _where(c[0]), needs_triton=True)


# ------------------------------------------------------------------ 4.3 the split-K merge
def _merge_cases() -> list[tuple]:
    """Two key ranges of one attention, each as (out, lse); then scores of 40 x a normal, log-
    sum-exps in the hundreds (exp overflows without the maximum), an empty range, two empty
    ranges."""
    gen = torch.Generator().manual_seed(0)
    cases = []
    for heads, keys, head_dim, split, scale in ((1, 8, 4, 3, 3), (4, 8, 4, 1, 3),
                                                (4, 8, 4, 7, 3), (2, 8, 4, 5, 3),
                                                (3, 16, 16, 9, 40)):
        scores = torch.randn(heads, keys, generator=gen) * scale
        values = torch.randn(keys, head_dim, generator=gen)
        parts = []
        for cols in (slice(0, split), slice(split, keys)):
            s = scores[:, cols]
            parts += [torch.softmax(s, -1) @ values[cols], torch.logsumexp(s, -1)]
        cases.append(tuple(parts))
    # log-sum-exps in the hundreds, past float32's exp overflow (88.7): only the max saves it
    cases.append((torch.randn(2, 4, generator=gen), torch.tensor([300.0, 95.0]),
                  torch.randn(2, 4, generator=gen), torch.tensor([299.0, 120.0])))
    out = torch.randn(2, 4, generator=gen)
    cases.append((out, torch.tensor([0.5, -1.0]), torch.zeros(2, 4),
                  torch.full((2,), float("-inf"))))   # second split saw no keys
    cases.append((torch.zeros(2, 4), torch.tensor([0.5, float("-inf")]), torch.zeros(2, 4),
                  torch.full((2,), float("-inf"))))   # head 1: neither split saw a key
    return [tuple(t.contiguous().to(BACKEND.device) for t in case) for case in cases]


def _judge_merge(got, case: tuple) -> str | None:
    case = tuple(t.cpu() for t in case)
    out_a, lse_a, out_b, lse_b = case
    want_out, want_lse = reference.merge_attn_states(*case)
    if not (isinstance(got, (tuple, list)) and len(got) == 2
            and all(isinstance(t, torch.Tensor) for t in got)
            and got[0].shape == want_out.shape and got[1].shape == want_lse.shape):
        return (f"expected (out, lse) of shapes {tuple(want_out.shape)} and "
                f"{tuple(want_lse.shape)}, got {got!r:.80}")
    for name, t in zip(("out", "lse"), got, strict=True):
        if problem := launches.not_from_kernel(t, name):
            return problem
    got = (got[0].cpu(), got[1].cpu())
    for h in range(want_lse.shape[0]):
        part = (f"head {h} (lse_a = {lse_a[h].item():.4f}, lse_b = {lse_b[h].item():.4f})")
        if got[1][h].isnan():
            return (f"{part}: lse is NaN; both parts are empty here, so max(lse_a, lse_b) is "
                    "-inf and lse_x - max is -inf - -inf: subtract 0 there instead")
        if not torch.allclose(got[1][h], want_lse[h], atol=1e-5, equal_nan=False) and not (
                torch.isinf(want_lse[h]) and got[1][h] == want_lse[h]):
            if got[1][h].isinf() and torch.isfinite(want_lse[h]):
                return (f"{part}: lse = {got[1][h].item()}, want {want_lse[h].item():.4f}: "
                        "exp(lse) overflows float32 past 88.7; with m = max(lse_a, lse_b), "
                        "lse = m + log(exp(lse_a - m) + exp(lse_b - m))")
            return (f"{part}: lse = {got[1][h].item():.4f}, want {want_lse[h].item():.4f} "
                    "= log(exp(lse_a) + exp(lse_b)), the union's denominator")
        if got[0][h].isnan().any() and torch.isfinite(want_lse[h]):
            return (f"{part}: out holds NaN: exp(lse) overflows float32 past 88.7; subtract "
                    "m = max(lse_a, lse_b) before exp")
        if got[0][h].isnan().any():
            return (f"{part}: out holds NaN; both parts are empty here, so lse = -inf and "
                    "lse_x - lse is -inf - -inf: the answer is zeros")
        if not torch.allclose(got[0][h], want_out[h], atol=1e-5, rtol=1e-5):
            return (f"{part}: out = {got[0][h].tolist()}, want {want_out[h].tolist()} (each "
                    "part weighted by exp(lse_x - lse), its share of the union's denominator)")
    return None


def _merge_text(case: tuple) -> str:
    lse_a, lse_b = (", ".join(f"{x:.4g}" for x in t.tolist()) for t in (case[1], case[3]))
    return f"merging parts of shape {tuple(case[0].shape)}, lse_a [{lse_a}], lse_b [{lse_b}]"


def check_merge_attn_states(learner: Callable) -> Verdict:
    """Exercise 4.3: ``merge_attn_states(out_a, lse_a, out_b, lse_b) -> (out, lse)``."""
    return judge_cases("4.3 merge_attn_states", learner, _merge_cases(),
                       lambda fn, case: _judge_merge(fn(*case), case), _merge_text,
                       needs_triton=True)


EXERCISES = Exercises(
    Exercise("4.1", "the paged gather as a Triton kernel", check_gather_kv, hints=(
        "One program per token: pos = tl.program_id(0). Its key lives in physical block "
        "tl.load(table + pos // BLOCK_SIZE), at offset pos % BLOCK_SIZE.",
        "The caches are contiguous, so a token's num_kv_heads x head_dim values lie side by "
        "side: from its page and offset, at which element does its row start? tl.arange needs "
        "a power of two, so some lanes fall past the row: what keeps them from reading, and "
        "from writing? And how large does that start get for block 2**27 + 1?",
        "The row starts at (page * BLOCK_SIZE + offset) * ROW; cols = tl.arange(0, ROW_PAD) "
        "with ROW_PAD = triton.next_power_of_2(ROW), and mask=cols < ROW on the load and on "
        "the store. Cast the page to int64 before multiplying. Launch seq_len programs: the "
        "-1 entries past the last block are then never read.",
    ), solution=solutions.gather_kv, wrong=(_gather_in_torch,), needs_triton=True, rules=(
        Rule("read through block_table: a token's block is the table's entry, not its logical "
             "block", "seq_len=5, block_size=4", _gather_with(0)),
        Rule("the table holds blocks, not slots: the slot is block x block_size + offset",
             "seq_len=4, block_size=4", _gather_with(1)),
        Rule("the page index is 64-bit safe: one case's offset passes 2**31 elements",
             f"table [{HUGE_PAGE}, 3", _gather_int32_page),
        Rule("k and v come from a Triton kernel (not torch around a launch)",
             "seq_len=1, block_size=4", _gather_noop_then_torch),
        Rule("read only what the sequence owns: mask the load of a row's padding lanes",
             AT_END, _gather_with(2)),
        Rule("write only k and v's own rows: mask the store of the padding lanes too",
             "seq_len=23, block_size=8", _gather_with(3)),
    ), compare_with="load_pages and load_kv_tile in course_lib/kernels/paged_load.py: the same "
                    "address, for a tile of tokens at once and with every stride passed in"),
    Exercise("4.2", "the online-softmax decode loop as a Triton kernel", check_decode_one_head,
             hints=(
        "One program (grid (1,)) loops over the logical blocks, for logical in range(0, "
        "tl.cdiv(seq_len, BLOCK_SIZE)): it loads the block's page from the table, then a "
        "[BLOCK_SIZE, HEAD_DIM] tile of keys and one of values, as toy_online does in torch.",
        "Carry m (start tl.full([], float('-inf'), tl.float32)), the sum l and acc "
        "[HEAD_DIM] through the loop. Lanes past seq_len: load K and V with mask and "
        "other=0.0, and set their scores to -inf with tl.where, so exp gives 0.",
        "Per block: m_new = max(m, max(s)); multiply l and acc by exp(m - m_new); add "
        "sum(exp(s - m_new)) and sum(exp(s - m_new)[:, None] * v, 0); store acc / l.",
    ), solution=solutions.decode_one_head, wrong=(_decode_with_course_kernel,),
        needs_triton=True, rules=(
        Rule("the running sums are rescaled when a block raises the maximum (online softmax)",
             "seq_len=5, block_size=4", _decode_with(False)),
        Rule("slots past seq_len hold NaN: mask the K and V loads", "seq_len=5, block_size=4",
             _decode_with(True)),
        Rule("scores are scaled by 1/sqrt(head_dim)", "seq_len=4, block_size=4",
             _decode_unscaled),
        Rule("out comes from the learner's own kernel", "seq_len=1, block_size=4",
             _decode_noop_then_torch),
    ), compare_with="the loop of course_lib/kernels/paged_decode.py: the same loop for a tile "
                    "of tokens and a group of query heads, in base 2"),
    Exercise("4.3", "the split-K merge as a Triton kernel", check_merge_attn_states, hints=(
        "One program per head (grid (num_heads,)): h = tl.program_id(0) loads lse_a[h] and "
        "lse_b[h] (scalars) and the HEAD_DIM values of out_a and out_b at h * HEAD_DIM + "
        "tl.arange(0, HEAD_DIM). exp(lse_a) and exp(lse_b) are the two parts' denominators; "
        "the union's is their sum.",
        "lse = m + log(exp(lse_a - m) + exp(lse_b - m)) with m = max(lse_a, lse_b), so no exp "
        "overflows; out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b. When both parts "
        "are empty m is -inf, and -inf - -inf is NaN: tl.where(m == float('-inf'), 0.0, m), and "
        "the same for lse before the weights.",
        "Both weights are shares of one denominator: exp(lse_a - lse) + exp(lse_b - lse) = 1. "
        "Check that your kernel keeps that true when one side is -inf, and when both are.",
    ), solution=solutions.merge_attn_states, wrong=(_merge_in_torch,), needs_triton=True,
        rules=(
        Rule("each part is weighted by its share of the union's denominator, exp(lse_x - lse)",
             "lse_a [0.5, -1]", _merge_average),
        Rule("log-sum-exps in the hundreds: subtract the max before exp",
             "lse_a [300, 95]", _merge_without_max),
        Rule("both ranges empty: zeros and lse = -inf, not NaN", "lse_b [-inf, -inf]",
             _merge_nan_when_both_empty),
        Rule("out and lse come from the learner's own kernel (never handed to it)",
             "lse_a [300, 95]", _merge_noop_then_torch),
        Rule("out and lse hold what the kernel wrote (not torch writing after the launch)",
             "lse_a [300, 95]", _merge_torch_into_kernel_output),
    ), compare_with="reference.merge_attn_states in course_lib/kernels/reference.py, then the "
                    "reduce kernel of course_lib/kernels/paged_decode.py, which merges any "
                    "number of splits in base 2. vLLM 0.33.0's merge_attn_states_kernel "
                    "(vllm/v1/attention/ops/triton_merge_attn_states.py) is this kernel with a "
                    "program per (token, head): it too gives zeros and lse = -inf when both "
                    "sides are empty"),
)


hint = EXERCISES.print_hint            # ch04.hint("N.M"): the next graded hint
solution = EXERCISES.print_solution    # ch04.solution("N.M"): a solution's code

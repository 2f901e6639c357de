"""Chapter 09 exercises: where context parallelism puts each token, the decode step's
MAX-then-SUM merge over ranks, and how long a generation each layout holds.

* 9.1 ``place_tokens``: the positions each rank stores after a prompt and some decode steps, in
  the tutorial's contiguous layout and in vLLM's interleaved one (reference:
  ``CPCase.rank_of`` of :mod:`course_lib.parallel.cp_decode`);
* 9.2 ``cp_decode``: one decode step's attention with the keys spread over ranks, merged as
  the all-reduces do (reference: attention over all the keys on one rank);
* 9.3 ``max_decode_steps``: decode steps before one rank's pool is full.

Checkers run edge cases (empty ranks, one rank, a prompt that fills a rank, scores that
overflow ``exp``) and random ones from a fixed seed; feedback names the token, the head or the
rank that differs.
"""

from __future__ import annotations

import contextlib
import copy
import random
from collections.abc import Callable, Iterator

import torch

from course_lib.exercises import Exercise, Exercises, Rule, Verdict, judge_cases, returns
from course_lib.exercises.solutions import ch09 as solutions
from course_lib.parallel.cp_decode import CPCase
from course_lib.parallel.merge import partial_attention
from course_lib.sizing.units import cdiv


def _case(prompt_len: int, cp_size: int, interleave_size: int) -> tuple[CPCase, int]:
    placement = "interleaved" if interleave_size else "contiguous"
    return CPCase(prompt_len=prompt_len, placement=placement,
                  interleave_size=max(1, interleave_size)), cp_size


def place_tokens(prompt_len: int, num_steps: int, cp_size: int,
                 interleave_size: int) -> list[list[int]]:
    """Reference of 9.1: each rank's positions, ascending (``interleave_size`` 0: contiguous)."""
    case, cp = _case(prompt_len, cp_size, interleave_size)
    ranks: list[list[int]] = [[] for _ in range(cp)]
    for p in range(prompt_len + num_steps):
        ranks[case.rank_of(p, cp)].append(p)
    return ranks


def _layout(interleave_size: int) -> str:
    return (f"interleaved by {interleave_size}" if interleave_size else "contiguous")


def _where(judge: Callable) -> Callable[[tuple], str]:
    """A case in words, as its judge says it (``describe=True``)."""
    return lambda case: judge(case, None, describe=True)


def _judge_places(case: tuple, got, describe: bool = False) -> str | None:
    prompt_len, steps, cp, inter = case
    where = f"prompt {prompt_len}, {steps} decode steps, cp_size {cp}, {_layout(inter)}"
    if describe:
        return where
    want = place_tokens(*case)
    try:
        got = [sorted(int(p) for p in r) for r in got]
    except TypeError:
        return f"{where}: returned {got!r}, not one list of positions per rank"
    if got == want:
        return None
    if len(got) != cp:
        return f"{where}: {len(got)} ranks, should be {cp} (an empty rank is an empty list)"
    seen: dict[int, list[int]] = {}
    for r, positions in enumerate(got):
        for p in positions:
            seen.setdefault(p, []).append(r)
    for p in range(prompt_len + steps):
        right = next(r for r, ps in enumerate(want) if p in ps)
        kind = "a prompt token" if p < prompt_len else f"decode step {p - prompt_len}'s token"
        if seen.get(p) != [right]:
            on = ("on no rank" if p not in seen else f"on rank {seen[p][0]}"
                  if len(seen[p]) == 1 else f"on ranks {seen[p]}")
            return f"{where}: position {p} ({kind}) is {on}, should be on rank {right}"
    return f"{where}: positions {sorted(set(seen) - set(range(prompt_len + steps)))} do not exist"


def check_place_tokens(fn: Callable[[int, int, int, int], list[list[int]]]) -> Verdict:
    rng = random.Random(9)
    cases = [(21, 6, 4, 0), (21, 6, 4, 2), (2, 3, 4, 0), (2, 3, 4, 1), (5, 0, 1, 0),
             (16, 4, 4, 0), (7, 5, 3, 3), (1, 1, 2, 0), (30, 4, 2, 2), (37, 2, 4, 4)]
    cases += [(rng.randint(1, 40), rng.randint(0, 12), rng.randint(1, 8),
               rng.choice([0, 0, 1, 2, 4])) for _ in range(20)]
    return judge_cases("9.1 place_tokens", fn, cases, returns(_judge_places),
                       _where(_judge_places))


def cp_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, owner: list[int],
              cp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of 9.2: what CP must reproduce, attention over every key on one rank."""
    return partial_attention(q, k, v)


def _decode_cases() -> list[tuple]:
    cases = []
    specs = [  # (tokens, heads, kv heads, cp, owner rule, key scale, seed)
        (11, 4, 2, 2, "contiguous", 1.0, 0), (3, 4, 2, 4, "contiguous", 1.0, 1),
        (1, 2, 1, 4, "contiguous", 1.0, 2), (9, 8, 2, 1, "contiguous", 1.0, 3),
        (20, 4, 4, 4, "interleaved", 1.0, 4), (12, 4, 2, 3, "interleaved", 3000.0, 5),
        (10, 2, 1, 4, "one rank", 1.0, 6), (16, 8, 1, 4, "random", 50.0, 7)]
    rng = random.Random(90)
    specs += [(rng.randint(1, 30), 4, rng.choice([1, 2, 4]), rng.randint(1, 6),
               rng.choice(["contiguous", "interleaved", "random"]), rng.choice([1.0, 5.0]),
               100 + i) for i in range(8)]
    for n, heads, kv_heads, cp, rule, scale, seed in specs:
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(heads, 16, generator=g, dtype=torch.float64)
        k = scale * torch.randn(n, kv_heads, 16, generator=g, dtype=torch.float64)
        v = torch.randn(n, kv_heads, 16, generator=g, dtype=torch.float64)
        if rule == "contiguous":
            owner = [next(r for r in range(cp) if r * n // cp <= i < (r + 1) * n // cp)
                     for i in range(n)]
        elif rule == "interleaved":
            owner = [i % cp for i in range(n)]
        elif rule == "one rank":
            owner = [cp - 1] * n
        else:
            owner = [int(torch.randint(cp, (1,), generator=g)) for _ in range(n)]
        cases.append((q, k, v, owner, cp))
    return cases


def _why_not_finite(case: tuple) -> str:
    """What makes a merge give NaN or inf on ``case``: scores past ``exp``'s range (the max
    was not subtracted), or a rank that holds nothing (its ``-inf`` LSE met another
    ``-inf`` or an ``inf``). Two mistakes, two hints."""
    q, k, v, owner, cp = case
    group = q.shape[0] // k.shape[1]
    scores = (k.repeat_interleave(group, dim=1) * q[None]).sum(-1) * q.shape[-1] ** -0.5
    if float(scores.abs().max()) > 80:       # float32's exp overflows past 88.7
        return (f"scores reach {float(scores.abs().max()):.0f} here, so exp() of an LSE "
                "overflows: subtract the MAX of the ranks' LSEs before exp")
    empty = [r for r in range(cp) if r not in owner]
    if empty:
        return (f"rank(s) {empty} hold nothing, so their (zeros, -inf) must weigh "
                "exp(-inf - max) = 0: a NaN comes from -inf - -inf (a max that left out the "
                "ranks holding tokens) or from dividing an empty rank's sums (0 / 0)")
    return "a weight exp(lse_r - max) or the SUM of the weights is not finite"


def _judge_decode(case: tuple, got, describe: bool = False) -> str | None:
    q, k, v, owner, cp = case
    empty = [r for r in range(cp) if r not in owner]
    where = (f"{k.shape[0]} tokens on {cp} ranks (owner {owner}"
             + (f"; ranks {empty} hold nothing" if empty else "") + ")")
    if describe:
        return where
    want_out, want_lse = cp_decode(*case)
    if not (isinstance(got, tuple) and len(got) == 2
            and all(isinstance(t, torch.Tensor) for t in got)):
        return f"{where}: returned {type(got).__name__}, not a pair of tensors (out, lse)"
    out, lse = got
    if out.shape != want_out.shape or lse.shape != want_lse.shape:
        return (f"{where}: shapes out {tuple(out.shape)}, lse {tuple(lse.shape)}; should be "
                f"{tuple(want_out.shape)} and {tuple(want_lse.shape)}")
    out, lse = out.to(torch.float64), lse.to(torch.float64)
    if not bool(torch.isfinite(out).all()):
        return f"{where}: out has NaN or inf: {_why_not_finite(case)}"
    bad = (out - want_out).abs().amax(dim=-1) > 1e-8
    if bool(bad.any()):
        h = int(bad.nonzero()[0])
        return (f"{where}: head {h}'s output is off by "
                f"{float((out[h] - want_out[h]).abs().max()):.3g} (weigh each rank's output "
                "by exp(lse_r - max) / the SUM of those weights)")
    if not torch.allclose(lse, want_lse, rtol=1e-9, atol=1e-9):
        h = int(((lse - want_lse).abs() > 1e-9).nonzero()[0])
        return (f"{where}: outputs right, head {h}'s lse is {float(lse[h]):.6g}, should be "
                f"{float(want_lse[h]):.6g} (the union's lse: max + log(SUM of the weights))")
    return None


@contextlib.contextmanager
def _watched(fn: Callable, calls: list[torch.Tensor]) -> Iterator[None]:
    """While ``fn`` runs, ``partial_attention`` (the module's, and any global name of ``fn``
    bound to it, as a notebook's import makes) notes the keys of each call in ``calls``."""
    from course_lib.parallel import merge

    original = merge.partial_attention

    def spy(q, k, v, *args, **kwargs):
        calls.append(k)
        return original(q, k, v, *args, **kwargs)

    names = [n for n, value in getattr(fn, "__globals__", {}).items() if value is original]
    merge.partial_attention = spy
    for n in names:
        fn.__globals__[n] = spy
    try:
        yield
    finally:
        merge.partial_attention = original
        for n in names:
            fn.__globals__[n] = original


def _ranks_merged(case: tuple, calls: list[torch.Tensor]) -> str | None:
    """``None`` if every rank that holds tokens went through ``partial_attention`` on its
    own tokens alone, and no call mixed ranks; else the problem in words."""
    q, k, v, owner, cp = case
    mine = {r: k[[i for i, o in enumerate(owner) if o == r]] for r in range(cp)}

    def rank_of_call(keys: torch.Tensor) -> int | None:
        return next((r for r, ks in mine.items() if ks.shape == keys.shape
                     and torch.equal(ks, keys.to(ks.dtype))), None)

    where = _judge_decode(case, None, describe=True)
    for keys in calls:
        if rank_of_call(keys) is None:
            return (f"{where}: partial_attention was called on {keys.shape[0]} key(s) that "
                    "are not one rank's tokens: each rank attends over its own tokens only "
                    "(k[i] for owner[i] == r), and the ranks' results are then merged")
    attended = {rank_of_call(keys) for keys in calls}
    missed = [r for r in range(cp) if mine[r].shape[0] and r not in attended]
    if missed:
        return (f"{where}: right numbers, but rank(s) {missed} never attended over their "
                "tokens with partial_attention(q, k_r, v_r): this exercise is the merge of the "
                "ranks' partial results, not attention over all the tokens at once")
    return None


def _judge_cp(learner: Callable, case: tuple) -> str | None:
    calls: list[torch.Tensor] = []
    with _watched(learner, calls):
        got = learner(*copy.deepcopy(case))
    return _judge_decode(case, got) or _ranks_merged(case, calls)


def check_cp_decode(fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> Verdict:
    """Exercise 9.2: ``cp_decode(q, k, v, owner, cp_size) -> (out, lse)``, each rank's
    ``partial_attention`` over its own tokens, merged; attention over all the tokens at once
    gives the same numbers but fails (the merge is the exercise)."""
    return judge_cases("9.2 cp_decode", fn, _decode_cases(), _judge_cp,
                       _where(_judge_decode))


def max_decode_steps(prompt_len: int, cp_size: int, interleave_size: int,
                     num_gpu_blocks: int, block_size: int) -> int:
    """Reference of 9.3: decode steps until the next token's rank has no free slot."""
    case, cp = _case(prompt_len, cp_size, interleave_size)
    held, room = [0] * cp, num_gpu_blocks * block_size
    for p in range(prompt_len):
        held[case.rank_of(p, cp)] += 1
    steps = 0
    while held[case.rank_of(prompt_len + steps, cp)] < room:
        held[case.rank_of(prompt_len + steps, cp)] += 1
        steps += 1
    return steps


def _judge_steps(case: tuple, got, describe: bool = False) -> str | None:
    prompt_len, cp, inter, blocks, bs = case
    where = (f"prompt {prompt_len}, cp_size {cp}, {_layout(inter)}, {blocks} blocks of {bs} "
             "per rank")
    if describe:
        return where
    want = max_decode_steps(*case)
    if got == want:
        return None
    ranks = place_tokens(prompt_len, want, cp, inter)
    full = [r for r, ps in enumerate(ranks) if len(ps) == blocks * bs]
    return (f"{where}: {got!r} steps, the library {want}: after {want} steps the ranks hold "
            f"{[len(ps) for ps in ranks]} tokens and the next token goes to a full rank "
            f"(full: {full})")


def check_max_decode_steps(fn: Callable[[int, int, int, int, int], int]) -> Verdict:
    rng = random.Random(93)
    cases = [(20, 4, 0, 2, 4), (20, 4, 1, 2, 4), (8, 2, 0, 1, 4), (3, 4, 0, 1, 1),
             (3, 4, 1, 1, 1), (16, 1, 0, 2, 8), (21, 4, 2, 2, 4), (100, 8, 0, 4, 16),
             (100, 8, 16, 4, 16)]
    while len(cases) < 30:
        cp, inter, blocks, bs = (rng.randint(1, 8), rng.choice([0, 1, 2, 4, 16]),
                                 rng.randint(1, 8), rng.choice([1, 4, 16]))
        prompt = rng.randint(1, cp * blocks * bs)
        if max(map(len, place_tokens(prompt, 0, cp, inter))) <= blocks * bs:   # it fits
            cases.append((prompt, cp, inter, blocks, bs))
    return judge_cases("9.3 max_decode_steps", fn, cases, returns(_judge_steps),
                       _where(_judge_steps))


# ---------------------------------------------------------------- plausible wrong answers
def _ceil_ranges(prompt_len, num_steps, cp_size, interleave_size):   # ceil-sized chunks
    if interleave_size:
        return solutions.place_tokens(prompt_len, num_steps, cp_size, interleave_size)
    chunk = cdiv(prompt_len, cp_size)
    ranks = [[] for _ in range(cp_size)]
    for p in range(prompt_len + num_steps):
        ranks[min(p // chunk, cp_size - 1)].append(p)
    return ranks


def _interleave_tokens_not_chunks(prompt_len, num_steps, cp_size, interleave_size):
    return solutions.place_tokens(prompt_len, num_steps, cp_size, 1 if interleave_size else 0)


def _no_max(q, k, v, owner, cp_size):                 # exp(lse) overflows
    parts = [partial_attention(q, k[[i for i, o in enumerate(owner) if o == r]],
                               v[[i for i, o in enumerate(owner) if o == r]])
             for r in range(cp_size)]
    w = [torch.exp(lse) for _, lse in parts]
    den = sum(w)
    return sum(wi[:, None] * o for wi, (o, _) in zip(w, parts, strict=True)) / den[:, None], \
        torch.log(den)


def _lse_is_the_max(q, k, v, owner, cp_size):         # forgets the log of the SUM
    out, lse = solutions.cp_decode(q, k, v, owner, cp_size)
    parts = [partial_attention(q, k[[i for i, o in enumerate(owner) if o == r]],
                               v[[i for i, o in enumerate(owner) if o == r]])
             for r in range(cp_size)]
    return out, torch.stack([p[1] for p in parts]).max(dim=0).values


def _whole_pool(prompt_len, cp_size, interleave_size, num_gpu_blocks, block_size):
    return cp_size * num_gpu_blocks * block_size - prompt_len      # ignores the placement


def _balanced_decode(prompt_len, cp_size, interleave_size, num_gpu_blocks, block_size):
    if interleave_size:
        return _whole_pool(prompt_len, cp_size, interleave_size, num_gpu_blocks, block_size)
    return num_gpu_blocks * block_size - prompt_len // cp_size     # forgets the last range


def _dense(q, k, v, owner, cp_size):
    """Wrong for this exercise: attention over all the tokens at once, no ranks, no merge."""
    return partial_attention(q, k, v)


EXERCISES = Exercises(
    Exercise("9.1", "place_tokens", check_place_tokens, hints=(
        "Decide the rank of one position at a time, then loop over positions 0 .. prompt_len "
        "+ num_steps - 1 and append each to its rank's list.",
        "Interleaved: chunk number position // interleave_size, dealt round-robin, so rank "
        "(position // interleave_size) % cp_size. Contiguous: a prompt position p is on the "
        "rank r with r * P // cp <= p < (r + 1) * P // cp; a decode token on rank cp - 1.",
    ), solution=solutions.place_tokens, rules=(
        Rule("contiguous: rank r holds positions r * P // cp .. (r + 1) * P // cp - 1",
             "prompt 21, 6 decode steps, cp_size 4, co",
             _ceil_ranges),
        Rule("interleaved: chunks of interleave_size positions, dealt round-robin",
             "prompt 21, 6 decode steps, cp_size 4, in",
             _interleave_tokens_not_chunks),
    ),
        trivial=(lambda *a: None, lambda *a: []), compare_with=(
        "CPCase.rank_of in course_lib/parallel/cp_decode.py and split_ranges in "
        "course_lib/parallel/merge.py; draw_cp_layout draws the result")),
    Exercise("9.2", "cp_decode", check_cp_decode, hints=(
        "Per rank r: the indices i with owner[i] == r; partial_attention(q, k[idx], v[idx]) "
        "gives (out_r, lse_r), and (zeros, -inf) for a rank with no token.",
        "Merge as the network does: m = the MAX of the lse_r (one all-reduce), w_r = exp(lse_r "
        "- m), then the SUM of w_r * out_r and the SUM of w_r (two more): out = num / den, "
        "lse = m + log(den). Subtracting m keeps exp() finite and an empty rank at weight 0.",
        "An empty rank's lse is -inf: after subtracting m its weight exp(-inf) is 0, so it "
        "needs no special case; but if every weight were computed without m, one score in "
        "the thousands makes exp() inf.",
    ), solution=solutions.cp_decode, rules=(
        Rule("subtract the MAX of the ranks' LSEs before exp (scores in the thousands)",
             "12 tokens on 3 ranks", _no_max),
        Rule("lse is the union's: max + log(SUM of the weights)", "11 tokens on 2 ranks",
             _lse_is_the_max),
        Rule("each rank attends over its own tokens only, and the results are merged",
             "11 tokens on 2 ranks", _dense),
    ), compare_with="cp_merge in course_lib/parallel/cp_decode.py (the all-reduce version) and "
                    "merge_partials in course_lib/parallel/merge.py"),
    Exercise("9.3", "max_decode_steps", check_max_decode_steps, hints=(
        "Count the prompt tokens each rank holds (your 9.1), then add decode tokens one at a "
        "time to the rank their position goes to; stop when that rank already holds "
        "num_gpu_blocks * block_size tokens.",
        "Contiguous: every decode token lands on the last rank, so the answer is that rank's "
        "room left after its prompt range. Interleaved: the ranks fill in turn, and the first "
        "rank that is full when its turn comes ends the run.",
    ), solution=solutions.max_decode_steps, rules=(
        Rule("a token goes to the rank its position is placed on (as in 9.1), not to any rank "
             "with room",
             "prompt 20, cp_size 4, co",
             _whole_pool),
        Rule("contiguous: every decode token goes to the last rank",
             "prompt 3, cp_size 4, con",
             _balanced_decode),
    ), compare_with=(
        "CPCase.rank_of in course_lib/parallel/cp_decode.py; capacity.context_parallel_capacity "
        "in course_lib/capacity.py is the best case")),
)


hint = EXERCISES.print_hint            # ch09.hint("N.M"): the next graded hint
solution = EXERCISES.print_solution    # ch09.solution("N.M"): a solution's code

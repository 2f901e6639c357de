"""Chapter 02 exercises: where every slot of the KV cache goes (token states, reservation,
internal and external fragmentation), and a first-fit allocator.

Each ``check_*`` runs the learner's function and the library's on the same cases (edge cases
first, then random ones from a fixed seed) and returns a :class:`Verdict` that names the first
difference in the chapter's terms.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from course_lib.exercises import (
    Exercise,
    Exercises,
    Rule,
    Verdict,
    judge_cases,
    returns,
    rule_wrongs,
)
from course_lib.exercises.solutions import ch02 as solutions
from course_lib.sim.static import CATEGORIES, ContiguousAllocator, reservation
from course_lib.sizing.units import cdiv


def split_memory(residents: list[tuple[int, int, int]], holes: list[int],
                 head_need: int | None) -> dict[str, int]:
    """Reference: the paper's split of memory (its Fig. 2), in slots, at one moment.

    ``residents``: ``(held, tokens_now, final_len)`` per request in memory, ``tokens_now <=
    final_len <= held``; ``holes``: the lengths of the free ranges; ``head_need``: the slots the
    request at the head of the queue needs in one range, or None when nobody waits. Returns
    ``token_states`` (KV already computed), ``reserved`` (held for tokens still to come),
    ``internal`` (held but never to be used), ``external`` (free slots, all of them, when the
    head waits and no hole holds it; else 0) and ``free`` (the rest of the free slots).
    """
    out = dict.fromkeys(CATEGORIES, 0)
    for held, now, final in residents:
        if not 0 <= now <= final <= held:
            raise ValueError(f"need 0 <= tokens_now <= final_len <= held, got {now, final, held}")
        out["token_states"] += now
        out["reserved"] += final - now
        out["internal"] += held - final
    free = sum(holes)
    if head_need is not None and max(holes, default=0) < head_need:
        out["external"] = free
    out["free"] = free - out["external"]
    return out


def _resident(rng: random.Random, policy: str) -> tuple[int, int, int]:
    final = rng.randrange(1, 2049)
    now = rng.randrange(0, final + 1)
    held = cdiv(final, 16) * 16 if policy == "paged" else reservation(policy, final)
    return held, now, final


def split_cases() -> list[tuple]:
    rng = random.Random(21)
    cases = [
        ([(1024, 256, 256), (1024, 512, 512), (1024, 128, 128)], [], None),  # the article's
        ([(1024, 100, 300)], [2048, 1024], 1500),    # E blocked: every free slot external
        ([(1024, 100, 300)], [1000, 1500], 1500),    # a hole of exactly 1500: E fits
        ([(1024, 100, 300)], [100, 50], None),       # nobody waits: free is free
        ([], [4096], 2048),                           # empty memory, the head fits
        ([], [], 1),                                  # no memory at all, and someone waits
        ([(48, 33, 40)], [16, 16], 32),               # paged: 3 blocks, the last one part-used
        ([(8, 8, 8)], [0], None),                     # full request, a zero-length hole
    ]
    for _ in range(30):
        policy = rng.choice(["max", "pow2", "oracle", "paged"])
        residents = [_resident(rng, policy) for _ in range(rng.randrange(0, 6))]
        holes = [rng.randrange(0, 2049) for _ in range(rng.randrange(0, 4))]
        head = rng.choice([None, rng.randrange(1, 2049), max(holes, default=0),
                           max(holes, default=0) + 1])
        cases.append((residents, holes, head))
    return cases


def _concept(key: str) -> str:
    return {"token_states": "the tokens each request holds now",
            "reserved": "slots held for tokens the request will still produce "
                        "(final_len - tokens_now)",
            "internal": "slots held past the final length, never used (held - final_len)",
            "external": "all the free slots when the waiting request fits in no single hole "
                        "(a hole of exactly its size holds it), else 0",
            "free": "the free slots that are not external fragmentation"}[key]


def _judge_split(case: tuple, got) -> str | None:
    want = split_memory(*case)
    if not isinstance(got, dict):
        return f"{_split_text(case)}: returned {got!r:.60}, not a dict of the five categories"
    if got == want:
        return None
    key = next((k for k in CATEGORIES if got.get(k) != want[k]), None)
    return f"{_split_text(case)}: " + (
        f"{key} = {got.get(key)!r}, the library {want[key]} ({_concept(key)})"
        if key else f"extra keys {sorted(set(got) - set(want))}")


def _split_text(case: tuple) -> str:
    return f"residents {case[0]}, holes {case[1]}, head_need {case[2]}"


def check_split_memory(fn: Callable) -> Verdict:
    """2.1: compare the five numbers; a difference names the category and what it counts."""
    return judge_cases("2.1 split_memory", fn, split_cases(), returns(_judge_split), _split_text)


def first_fit(num_slots: int, events: list[tuple[str, int]]) -> list[int | None]:
    """Reference first-fit allocator over ``[0, num_slots)``.

    events: ``("alloc", size)`` asks for ``size`` contiguous slots; ``("free", i)`` frees what
    the event at index ``i`` (an earlier, successful "alloc") got. Returns, for each "alloc"
    event in order, the start slot it got (the lowest hole that fits) or None.
    """
    alloc = ContiguousAllocator(num_slots)
    starts: dict[int, int | None] = {}
    for i, (kind, value) in enumerate(events):
        if kind == "alloc":
            starts[i] = alloc.allocate(value)
        else:
            alloc.free(starts[value])
    return list(starts.values())


def _random_events(rng: random.Random, num_slots: int, n: int) -> list[tuple[str, int]]:
    events: list[tuple[str, int]] = []
    live: list[int] = []                      # indices of successful, not yet freed allocs
    model, model_starts = ContiguousAllocator(num_slots), {}
    for _ in range(n):
        if live and rng.random() < 0.4:
            i = live.pop(rng.randrange(len(live)))
            events.append(("free", i))
            model.free(model_starts[i])
        else:
            events.append(("alloc", rng.randrange(1, num_slots // 3 + 2)))
            start = model.allocate(events[-1][1])
            if start is not None:
                live.append(len(events) - 1)
                model_starts[len(events) - 1] = start
    return events


def first_fit_cases() -> list[tuple[int, list[tuple[str, int]]]]:
    rng = random.Random(24)
    cases = [
        (10, [("alloc", 3), ("alloc", 4), ("alloc", 2), ("free", 1), ("alloc", 5),
              ("alloc", 1)]),                                  # the chapter's strip
        (10, [("alloc", 10), ("alloc", 1), ("free", 0), ("alloc", 1)]),
        (8, [("alloc", 3), ("alloc", 3), ("free", 0), ("free", 1), ("alloc", 8)]),  # merges
        (8, [("alloc", 2), ("alloc", 2), ("alloc", 2), ("free", 0), ("free", 2),
             ("alloc", 4), ("alloc", 2)]),
        (9, [("alloc", 3), ("alloc", 3), ("alloc", 3), ("free", 2), ("free", 0),
             ("alloc", 2), ("alloc", 3), ("free", 1), ("alloc", 7)]),   # merge on both sides
        (5, [("alloc", 6)]),
        (4, []),
    ]
    for _ in range(30):
        size = rng.randrange(4, 40)
        cases.append((size, _random_events(rng, size, rng.randrange(1, 25))))
    return cases


def _judge_first_fit(case: tuple, got) -> str | None:
    num_slots, events = case
    want = first_fit(num_slots, events)
    if got is not None and list(got) == want:
        return None
    return f"{num_slots} slots, events {events}: " + _first_fit_diff(num_slots, events, got, want)


def check_first_fit(fn: Callable[[int, list[tuple[str, int]]], list[int | None]]) -> Verdict:
    """2.2: compare the starts; a difference names the alloc, the holes then, and the rule."""
    return judge_cases("2.2 first_fit", fn, first_fit_cases(), returns(_judge_first_fit),
                       lambda case: f"{case[0]} slots, events {case[1]}")


def _first_fit_diff(num_slots: int, events: list, got, want: list) -> str:
    if not isinstance(got, (list, tuple)) or len(got) != len(want):
        return f"returned {got!r:.60}; want one start (or None) per alloc: {want}"
    alloc, starts, k = ContiguousAllocator(num_slots), {}, 0
    for i, (kind, value) in enumerate(events):
        if kind == "free":
            alloc.free(starts[value])
            continue
        if got[k] != want[k]:
            holes = alloc.holes
            rule = ("first fit takes the lowest hole that is long enough"
                    if want[k] is not None else "no hole is long enough")
            if got[k] is None and want[k] is not None:
                rule = ("these holes are what is left when a freed range merges with its free "
                        "neighbours: without the merge no hole is long enough")
            return (f"event {i}, alloc of {value}: got {got[k]}, the library {want[k]}; the "
                    f"holes (start, length) were then {holes}: {rule}")
        starts[i] = alloc.allocate(value)
        k += 1
    return "the same starts, in another type"


def _split_forgets_reserved(residents, holes, head_need):
    """Wrong: counts the slots held for future tokens as internal fragmentation."""
    out = solutions.split_memory(residents, holes, head_need)
    out["internal"] += out["reserved"]
    out["reserved"] = 0
    return out


def _split_external_is_small_holes(residents, holes, head_need):
    """Wrong: external = the holes too small for the head, even when another hole holds it."""
    out = solutions.split_memory(residents, holes, head_need)
    free = sum(holes)
    out["external"] = sum(h for h in holes if head_need is not None and h < head_need)
    out["free"] = free - out["external"]
    return out


def _split_strict_fit(residents, holes, head_need):
    """Wrong: a hole of exactly the head's size counted as too small."""
    out = solutions.split_memory(residents, holes, head_need)
    if head_need is not None and max(holes, default=0) <= head_need:
        out["external"], out["free"] = sum(holes), 0
    return out


def _first_fit_no_merge(num_slots, events):
    holes, starts = [(0, num_slots)], {}
    for i, (kind, value) in enumerate(events):
        if kind == "alloc":
            j = next((j for j, h in enumerate(holes) if h[1] >= value), None)
            starts[i] = None if j is None else holes[j][0]
            if j is not None:
                holes[j] = (holes[j][0] + value, holes[j][1] - value)
        else:
            holes = sorted(holes + [(starts[value], events[value][1])])
    return list(starts.values())


def _best_fit(num_slots, events):
    """Wrong: the smallest hole that fits (best fit), not the lowest."""
    holes, starts = [(0, num_slots)], {}
    for i, (kind, value) in enumerate(events):
        if kind == "alloc":
            fits = [h for h in holes if h[1] >= value]
            starts[i] = min(fits, key=lambda h: (h[1], h[0]))[0] if fits else None
            if fits:
                s, n = min(fits, key=lambda h: (h[1], h[0]))
                holes.remove((s, n))
                holes = sorted(holes + ([(s + value, n - value)] if n > value else []))
        else:
            holes = sorted(holes + [(starts[value], events[value][1])])
            merged = [holes[0]]
            for s, n in holes[1:]:
                if merged[-1][0] + merged[-1][1] == s:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    merged.append((s, n))
            holes = merged
    return list(starts.values())


EXERCISES = Exercises(
    Exercise("2.1", "where every slot goes", check_split_memory, hints=(
        "Walk the residents: tokens_now slots hold KV (token states); final_len - tokens_now "
        "are held for tokens still to come (reserved); held - final_len will never be used "
        "(internal fragmentation).",
        "The free slots are sum(holes). They are external fragmentation only when someone "
        "waits (head_need is not None) and no single hole is at least head_need long; then all "
        "of them are, as in the paper's Fig. 2. max(holes, default=0) handles no holes.",
        "Return the five keys token_states, reserved, internal, external, free.",
    ), solution=solutions.split_memory,
        rules=(
        Rule("slots held for tokens still to come are reserved, not internal",
             "residents [(1024, 100, 300)], holes [204",
             _split_forgets_reserved),
        Rule("external only when no single hole holds head_need slots (else 0)",
             "residents [(1024, 100, 300)], holes [204",
             _split_external_is_small_holes),
        Rule("a hole of exactly head_need slots holds the head",
             "residents [(1024, 100, 300)], holes [1000, 1",
             _split_strict_fit),
    ),
        compare_with=(
        "simulate_static in course_lib/sim/static.py, which counts the same five at every step of"
        " a trace")),
    Exercise("2.2", "a first-fit allocator", check_first_fit, hints=(
        "Keep the holes as (start, length) pairs sorted by start, beginning with "
        "[(0, num_slots)]. An alloc takes the first hole with length >= size and carves the "
        "range from its front (a hole left with length 0 disappears).",
        "Remember each successful alloc's start by its event index: a free names that index, "
        "and its size is events[index][1].",
        "On free, insert the range and merge it with a hole that ends where it starts and one "
        "that starts where it ends.",
    ), solution=solutions.first_fit, rules=(
        Rule("a freed range merges with its free neighbours",
             "8 slots, events [('alloc', 3",
             _first_fit_no_merge),
        Rule("the lowest hole long enough (first fit), not the smallest",
             "10 slots, events [('alloc', 3), ",
             _best_fit),
        Rule("an allocation is carved from the front of its hole",
             "10 slots, events [('alloc', 3), ",
             rule_wrongs.first_fit_from_the_back),
    ), compare_with=(
        "ContiguousAllocator in course_lib/sim/static.py")),
)


hint = EXERCISES.print_hint            # ch02.hint("N.M"): the next graded hint
solution = EXERCISES.print_solution    # ch02.solution("N.M"): a solution's code

"""Chapter 02 exercises: internal waste, power-of-two reservations, paged waste, first fit.

Each ``check_*`` runs the learner's function and the library's on the same cases (edge cases
first, then random ones from a fixed seed) and returns a :class:`Verdict` that prints the
first difference.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from course_lib.exercises import Verdict, check
from course_lib.memory import cdiv
from course_lib.sim.static import ContiguousAllocator, next_power_of_two


def internal_waste(reserved: int, final_len: int) -> int:
    """Reference: slots of a reservation that the request never fills."""
    if not 0 <= final_len <= reserved:
        raise ValueError(f"need 0 <= final_len <= reserved, got {final_len}, {reserved}")
    return reserved - final_len


def pow2_reservation(n: int) -> int:
    """Reference: the smallest power of two >= n (Orca-Pow2's reservation)."""
    return next_power_of_two(n)


def paged_waste(final_len: int, block_size: int) -> int:
    """Reference: empty slots in the last block of a paged request of final_len tokens."""
    return cdiv(final_len, block_size) * block_size - final_len


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


def check_internal_waste(fn: Callable[[int, int], int]) -> Verdict:
    rng = random.Random(21)
    cases = [(1024, 256), (1024, 512), (1024, 128), (2048, 2048), (1, 0), (2048, 1)]
    cases += [(r, rng.randrange(0, r + 1)) for r in (rng.randrange(1, 4096) for _ in range(30))]
    return check("2.1 internal_waste", fn, internal_waste, cases)


def check_pow2_reservation(fn: Callable[[int], int]) -> Verdict:
    rng = random.Random(22)
    cases = [(n,) for n in (1, 2, 3, 4, 5, 7, 8, 9, 255, 256, 257, 1024, 1025, 2048, 2**40 + 1)]
    cases += [(rng.randrange(1, 100_000),) for _ in range(30)]
    return check("2.2 pow2_reservation", fn, pow2_reservation, cases)


def check_paged_waste(fn: Callable[[int, int], int]) -> Verdict:
    rng = random.Random(23)
    cases = [(1, 16), (15, 16), (16, 16), (17, 16), (50, 16), (1, 1), (2048, 16), (33, 32)]
    cases += [(rng.randrange(1, 4096), 2 ** rng.randrange(0, 8)) for _ in range(30)]
    return check("2.3 paged_waste", fn, paged_waste, cases)


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


def check_first_fit(fn: Callable[[int, list[tuple[str, int]]], list[int | None]]) -> Verdict:
    rng = random.Random(24)
    cases = [
        (10, [("alloc", 3), ("alloc", 4), ("alloc", 2), ("free", 1), ("alloc", 5),
              ("alloc", 1)]),                                  # the chapter's strip
        (10, [("alloc", 10), ("alloc", 1), ("free", 0), ("alloc", 1)]),
        (8, [("alloc", 3), ("alloc", 3), ("free", 0), ("free", 1), ("alloc", 8)]),  # merges
        (8, [("alloc", 2), ("alloc", 2), ("alloc", 2), ("free", 0), ("free", 2),
             ("alloc", 4), ("alloc", 2)]),
        (5, [("alloc", 6)]),
        (4, []),
    ]
    for _ in range(30):
        size = rng.randrange(4, 40)
        cases.append((size, _random_events(rng, size, rng.randrange(1, 25))))
    return check("2.4 first_fit", fn, first_fit, cases)

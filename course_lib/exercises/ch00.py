"""Chapter 00 exercises: two Triton kernels, masked over a length that is not a multiple of the
block.

The learner writes a ``@triton.jit`` kernel and the function that launches it. Each checker
hands that function its inputs as the first ``n`` elements of a longer buffer whose tail holds
NaN (+inf for a maximum, which skips NaN): what a lane past the end would read; and an output
that is the head of a buffer whose tail holds a sentinel, which a lane past the end would
overwrite. In the interpreter a load outside the tensors the kernel was handed is
stopped before it reads (so an unmasked load fails even where its lanes are not stored), and
``out`` must hold what the learner's kernel left in it (:mod:`course_lib.exercises.launches`).
It runs the edge cases, then random lengths from a fixed seed, and names the first element that
differs and the likely cause.

Under ``torch-reference`` there is no Triton: an unsolved stub is still reported as not
attempted, and anything else is told to run on a Triton backend.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from course_lib.device import BACKEND
from course_lib.exercises import Exercise, Exercises, Rule, Verdict, judge_cases, launches
from course_lib.exercises.solutions import ch00 as solutions
from course_lib.sizing.units import cdiv

SENTINEL = -999.0   # the output buffer's tail: a store past the end overwrites it
PAD = 256           # elements of NaN / sentinel after the inputs / the output


def padded(values: torch.Tensor, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(view, buffer)``: ``values`` as the head of a buffer with ``PAD`` elements of ``fill``."""
    buf = torch.full((values.numel() + PAD,), fill, dtype=values.dtype)
    buf[:values.numel()] = values
    buf = buf.to(BACKEND.device)
    return buf[:values.numel()], buf


def case_text(case: tuple) -> str:
    return ", ".join(f"{k}={v}" for k, v in case[-1].items())


def _lengths(seed: int) -> list[tuple[int, int]]:
    """(n, block_size): one element, under a block, exact multiples, one past, then random."""
    rng = random.Random(seed)
    fixed = [(1, 4), (3, 4), (4, 4), (5, 4), (10, 4), (16, 16), (17, 16), (100, 32), (257, 64),
             (1000, 128)]
    return fixed + [(rng.randrange(1, 600), 2 ** rng.randrange(2, 8)) for _ in range(10)]


# ------------------------------------------------------------------ 0.1 leaky ReLU
def leaky_relu_cases() -> list[tuple]:
    gen = torch.Generator().manual_seed(1)
    cases = []
    for j, (n, bs) in enumerate(_lengths(2)):
        alpha = (0.1, 0.01, 0.5)[j % 3]
        cases.append((torch.randn(n, generator=gen) * 3, dict(n=n, block_size=bs, alpha=alpha)))
    return cases


def _judge_leaky_relu(learner: Callable, case: tuple) -> str | None:
    values, meta = case
    n, bs, alpha = meta["n"], meta["block_size"], meta["alpha"]
    x, _ = padded(values, float("nan"))
    out, out_buf = padded(torch.full((n,), float("nan")), SENTINEL)
    learner(x, out, alpha, bs)
    want = torch.where(values > 0, values, alpha * values)
    got, tail = out.cpu(), out_buf[n:].cpu()
    where = f"n={n}, block_size={bs}"
    if problem := launches.not_from_kernel(out, "out"):
        return f"{where}: {problem}"
    if not torch.equal(x.cpu(), values):
        return f"{where}: the kernel changed x (store into out_ptr, not x_ptr)"
    if (tail != SENTINEL).any():
        count = int((tail != SENTINEL).sum())
        return (f"{where}: {count} element(s) after out[{n - 1}] were overwritten: a lane past "
                "the end stored; mask the store with offsets < n")
    unwritten = got.isnan().nonzero().flatten().tolist()
    if unwritten:
        i = unwritten[0]
        cause = ("was the kernel launched?" if len(unwritten) == n else
                 f"no program covers the last, partial block: the grid needs ceil(n / "
                 f"block_size) = {cdiv(n, bs)} program(s)" if i >= (n // bs) * bs else
                 "no program wrote it")
        return f"{where}: out[{i}] was never written ({len(unwritten)} such); {cause}"
    if not torch.allclose(got, want):
        i = int((got - want).abs().argmax())
        return (f"{where}, alpha={alpha}: out[{i}] = {got[i].item():.4f} for x[{i}] = "
                f"{values[i].item():.4f}; the library gives {want[i].item():.4f}")
    return None


def check_leaky_relu(fn: Callable) -> Verdict:
    """Exercise 0.1: ``leaky_relu(x, out, alpha, block_size)`` writes ``out[i] = x[i]`` where
    ``x[i] > 0``, else ``alpha * x[i]``, for the ``n = x.numel()`` elements, and nothing else."""
    return judge_cases("0.1 leaky_relu", fn, leaky_relu_cases(), _judge_leaky_relu, case_text,
                       needs_triton=True)


# ------------------------------------------------------------------ 0.2 block maxima
def block_max_cases() -> list[tuple]:
    gen = torch.Generator().manual_seed(3)
    cases = []
    for n, bs in _lengths(4):
        values = torch.randn(n, generator=gen) * 2
        if n % bs:                          # a last, partial block of negative numbers only
            values[(n // bs) * bs:] = -1 - values[(n // bs) * bs:].abs()
        cases.append((values, dict(n=n, block_size=bs)))
    return cases


def _judge_block_max(learner: Callable, case: tuple) -> str | None:
    values, meta = case
    n, bs = meta["n"], meta["block_size"]
    programs = cdiv(n, bs)
    x, _ = padded(values, float("inf"))    # NaN would not show: tl.max skips NaN
    out, out_buf = padded(torch.full((programs,), float("nan")), SENTINEL)
    learner(x, out, bs)
    if problem := launches.not_from_kernel(out, "out"):
        return f"n={n}, block_size={bs}: {problem}"
    padded_values = torch.cat([values, torch.full((programs * bs - n,), float("-inf"))])
    want = padded_values.view(programs, bs).max(dim=1).values
    got, tail = out.cpu(), out_buf[programs:].cpu()
    where = f"n={n}, block_size={bs}"
    if (tail != SENTINEL).any():
        return (f"{where}: out has {programs} elements (one per block) and something was "
                f"stored after out[{programs - 1}]: store one value per program, at out_ptr + pid")
    if got.isnan().any():
        b = int(got.isnan().nonzero()[0])
        return f"{where}: out[{b}] was never written: one program per block, each storing once"
    if (got == float("inf")).any():
        b = int((got == float("inf")).nonzero()[0])
        lo, hi = b * bs, min(n, (b + 1) * bs) - 1
        return (f"{where}: block {b} (x[{lo}..{hi}]) gives inf: its lanes past n were read "
                f"(the buffer after x holds inf there): load with mask=offsets < n")
    if not torch.allclose(got, want):
        b = int((got - want).abs().argmax())
        lo, hi = b * bs, min(n, (b + 1) * bs) - 1
        cause = (" (every element of that block is negative: the masked-off lanes must load "
                 "-inf, other=float('-inf'), so that they never win the max)"
                 if got[b].item() == 0.0 and want[b].item() < 0 else "")
        return (f"{where}: block {b} (x[{lo}..{hi}]): got {got[b].item():.4f}, the library "
                f"gives {want[b].item():.4f}{cause}")
    return None


def check_block_max(fn: Callable) -> Verdict:
    """Exercise 0.2: ``block_max(x, out, block_size)`` writes, for each block of ``block_size``
    elements of ``x`` (the last one partial), its maximum into ``out[block]``."""
    return judge_cases("0.2 block_max", fn, block_max_cases(), _judge_block_max, case_text,
                       needs_triton=True)


# ------------------------------------------------------------------ plausible wrong answers
if BACKEND.uses_triton:
    import triton
    import triton.language as tl

    @triton.jit
    def _leaky_unmasked_store(x_ptr, out_ptr, n, alpha, BLOCK_SIZE: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        x = tl.load(x_ptr + offsets, mask=offsets < n)
        tl.store(out_ptr + offsets, tl.where(x > 0, x, alpha * x))   # no mask

    @triton.jit
    def _leaky_unmasked_load(x_ptr, out_ptr, n, alpha, BLOCK_SIZE: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        x = tl.load(x_ptr + offsets)                                  # reads past n
        tl.store(out_ptr + offsets, tl.where(x > 0, x, alpha * x), mask=offsets < n)

    @triton.jit
    def _leaky_plain_relu(x_ptr, out_ptr, n, alpha, BLOCK_SIZE: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        x = tl.load(x_ptr + offsets, mask=offsets < n)
        tl.store(out_ptr + offsets, tl.maximum(x, 0.0), mask=offsets < n)   # alpha forgotten

    @triton.jit
    def _does_nothing(x_ptr, out_ptr):
        pass

    @triton.jit
    def _max_other_zero(x_ptr, out_ptr, n, BLOCK_SIZE: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0)     # 0 can win the max
        tl.store(out_ptr + tl.program_id(0), tl.max(x, axis=0))

    @triton.jit
    def _max_unmasked(x_ptr, out_ptr, n, BLOCK_SIZE: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        x = tl.load(x_ptr + offsets)                                  # reads past n
        tl.store(out_ptr + tl.program_id(0), tl.max(x, axis=0))


def _leaky_floor_grid(x, out, alpha, block_size):
    """Wrong: n // block_size programs, so the last, partial block is skipped."""
    n = x.numel()
    solutions.leaky_relu_kernel[(max(1, n // block_size),)](x, out, n, alpha,
                                                            BLOCK_SIZE=block_size)


def _leaky_no_store_mask(x, out, alpha, block_size):
    n = x.numel()
    _leaky_unmasked_store[(cdiv(n, block_size),)](x, out, n, alpha, BLOCK_SIZE=block_size)


def _leaky_no_load_mask(x, out, alpha, block_size):
    n = x.numel()
    _leaky_unmasked_load[(cdiv(n, block_size),)](x, out, n, alpha, BLOCK_SIZE=block_size)


def _leaky_relu_only(x, out, alpha, block_size):
    n = x.numel()
    _leaky_plain_relu[(cdiv(n, block_size),)](x, out, n, alpha, BLOCK_SIZE=block_size)


def _leaky_noop_then_torch(x, out, alpha, block_size):
    """Wrong for this exercise: a kernel that does nothing is launched on out, then torch
    writes the right numbers into out."""
    _does_nothing[(1,)](x, out)
    out.copy_(torch.where(x > 0, x, alpha * x))


def _max_noop_then_torch(x, out, block_size):
    """Wrong for this exercise: a kernel that does nothing, then the maxima from torch."""
    _does_nothing[(1,)](x, out)
    for b in range(out.numel()):
        out[b] = x[b * block_size:(b + 1) * block_size].max()


def _leaky_in_torch(x, out, alpha, block_size):
    """Wrong for this exercise: the right numbers, but no kernel."""
    out.copy_(torch.where(x > 0, x, alpha * x))


def _max_in_torch(x, out, block_size):
    """Wrong for this exercise: the right numbers, but no kernel."""
    for b in range(out.numel()):
        out[b] = x[b * block_size:(b + 1) * block_size].max()


def _max_zero_lanes(x, out, block_size):
    _max_other_zero[(out.numel(),)](x, out, x.numel(), BLOCK_SIZE=block_size)


def _max_no_mask(x, out, block_size):
    _max_unmasked[(out.numel(),)](x, out, x.numel(), BLOCK_SIZE=block_size)


EXERCISES = Exercises(
    Exercise("0.1", "a masked elementwise kernel", check_leaky_relu, hints=(
        "Copy the shape of _add_kernel, shown above the exercise: "
        "tl.program_id(0) says which block this program owns, offsets = pid * BLOCK_SIZE + "
        "tl.arange(0, BLOCK_SIZE) are its lanes.",
        "tl.where(x > 0, x, alpha * x) is the elementwise choice. The lanes with offsets >= n "
        "must neither load nor store: pass mask=offsets < n to tl.load and tl.store.",
        "Launch with leaky_relu_kernel[grid](x, out, n, alpha, BLOCK_SIZE=block_size) where "
        "grid = ((n + block_size - 1) // block_size,): the ceiling, or the last, partial block "
        "has no program.",
    ), solution=solutions.leaky_relu, wrong=(_leaky_in_torch,), needs_triton=True, rules=(
        Rule("out[i] = x[i] where x[i] > 0, alpha * x[i] otherwise", "n=4, block_size=4",
             _leaky_relu_only),
        Rule("one program per block of block_size: ceil(n / block_size) of them, n mostly not "
             "a multiple", "n=5, block_size=4", _leaky_floor_grid),
        Rule("out is followed by memory the kernel must not write: mask the store",
             "n=3, block_size=4", _leaky_no_store_mask),
        Rule("x is followed by NaN: a lane past n must not load (mask the load)",
             "n=3, block_size=4", _leaky_no_load_mask),
        Rule("a Triton kernel computes out (not torch around a launch)", "n=1, block_size=4",
             _leaky_noop_then_torch),
    ), compare_with="num_programs in course_lib/kernels/smoke.py, the grid of _add_kernel"),
    Exercise("0.2", "maximum of each block", check_block_max, hints=(
        "One program per block again, and one value out per program: tl.max(x, axis=0) "
        "reduces the block's lanes to a scalar, stored at out_ptr + pid.",
        "A masked-off lane must lose the max: tl.load(..., mask=offsets < n, other=...) "
        "fills it with `other`. What value can never be the maximum? (0.0 can.)",
        "other=float('-inf'): the one value no element can lose to.",
    ), solution=solutions.block_max, wrong=(_max_in_torch,), needs_triton=True, rules=(
        Rule("masked-off lanes must never win the max (a block of negatives)",
             "n=5, block_size=4", _max_zero_lanes),
        Rule("x is followed by memory the kernel must not read: mask the load",
             "n=3, block_size=4", _max_no_mask),
        Rule("a Triton kernel computes the maxima (not torch around a launch)",
             "n=1, block_size=4", _max_noop_then_torch),
    ), compare_with="m_i in course_lib/kernels/paged_decode.py: chapter 04's decode kernel "
                    "starts its running maximum at -inf the same way"),
)


hint = EXERCISES.print_hint            # ch00.hint("N.M"): the next graded hint
solution = EXERCISES.print_solution    # ch00.solution("N.M"): a solution's code

"""Which Triton kernels a learner's answer launched.

A Triton exercise is about writing the kernel, so a checker must tell a ``@triton.jit`` kernel
from the same numbers computed in torch (or by the course's own kernels). Triton launches every
kernel through ``kernel[grid](...)``, which calls ``run`` on the kernel object: a
``JITFunction`` when compiled, an ``InterpretedFunction`` under ``TRITON_INTERPRET=1``
(``triton/runtime/jit.py``, ``triton/runtime/interpreter.py``, Triton 3.x). :func:`recorded`
wraps both ``run`` methods for the length of a check and notes each kernel's module and name;
an autotuned or heuristics-wrapped kernel reaches the same ``run`` underneath.

The learner's own launches are watched more closely, so that the answer must come from the
kernel, not from torch around it:

* right after each such launch returns, the spy copies every tensor it was handed (up to
  ``SNAPSHOT_BYTES``); :func:`not_from_kernel` then asks that an answer be a tensor some launch
  was handed and hold what that launch left in it (a kernel that does nothing, followed by
  the answer computed in torch into the same buffer, fails);
* in the interpreter, each load is checked before it reads and each store before it writes:
  an address outside every tensor the kernel was handed (a lane past the end that was not
  masked, an offset that overflowed 32 bits) raises :class:`OutOfBounds`, naming the argument,
  instead of touching it. On a GPU such a load reads garbage or faults; such a store corrupts
  memory, and in the interpreter (numpy writing through a raw address) it can kill the Python
  process, so a notebook's kernel dies with no verdict. Stores are checked exactly as loads.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from course_lib.device import BACKEND

COURSE_KERNELS = "course_lib.kernels"   # the library's kernels: reading them is the last hint
SNAPSHOT_BYTES = 64 * 2**20             # larger tensors (inputs) are not copied after a launch


class OutOfBounds(Exception):
    """A learner's kernel loaded from, or stored to, an address outside every tensor it was
    handed (interpreter only)."""


@dataclass
class Launch:
    """One launch of a learner's kernel: its name, and each tensor argument with a copy of it
    taken right after the launch returned (``None`` for a tensor too large to copy)."""
    kernel: str
    tensors: list[tuple[str, Any, Any]] = field(default_factory=list)  # (name, tensor, copy)


_launches: list[Launch] = []               # the learner's launches in the current case
own_ran = [False]   # a learner's kernel was launched in this check (not reset per case)
_extents: list[tuple[str, int, int]] | None = None   # (name, first byte, end) while one runs


def new_case() -> None:
    """Forget the launches seen so far: a checker calls it before each case."""
    _launches.clear()


def out_of_bounds_in(exc: BaseException) -> OutOfBounds | None:
    """The :class:`OutOfBounds` an exception was raised from (the interpreter wraps it)."""
    while exc is not None:
        if isinstance(exc, OutOfBounds):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _named_tensors(fn: Any, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    import torch

    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        names = []
    named = [(names[i] if i < len(names) else f"argument {i}", a) for i, a in enumerate(args)]
    named += list(kwargs.items())
    return [(n, a) for n, a in named if isinstance(a, torch.Tensor)]


def _extent(t: Any) -> tuple[int, int]:
    """The bytes ``[first, end)`` a tensor view spans."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    span = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(),
                                                                strict=True))
    return t.data_ptr(), t.data_ptr() + (span + 1) * t.element_size()


def _outside(addresses: Any, width: int, verb: str = "loaded") -> str | None:
    """Why a load (``verb`` "loaded") or a store ("stored") of ``width``-byte elements at
    ``addresses`` leaves every watched tensor."""
    import numpy as np

    assert _extents is not None
    ok = np.zeros(addresses.shape, dtype=bool)
    for _, lo, hi in _extents:
        ok |= (addresses >= lo) & (addresses + width <= hi)
    if ok.all():
        return None
    bad = int(addresses[~ok][0])
    name, lo, hi = min(_extents, key=lambda e: min(abs(bad - e[1]), abs(bad - e[2])))
    if 0 <= bad - hi < 2**24:
        where = (f"element {(bad - lo) // width} of {name}, past its end (it has "
                 f"{(hi - lo) // width})")
        fix = ("mask the lanes past the end (mask=offsets < n)" if verb == "loaded" else
               "mask the store (mask=offsets < n): a lane past the end must not write")
    elif 0 < lo - bad < 2**24:
        where = f"{(lo - bad) // width} element(s) before the start of {name}"
        fix = "a negative offset: is a -1 entry followed, or an index read unmasked?"
    else:
        where = f"an address far from every tensor (nearest: {name})"
        fix = ("an offset that overflowed: compute offsets that can pass 2**31 in 64 bits "
               "(.to(tl.int64))")
    return f"a lane of your kernel {verb} {where}: {fix}"


def not_from_kernel(answer: Any, name: str) -> str | None:
    """``None`` if the tensor ``answer`` was handed to one of the learner's launches in this
    case and still holds what the last such launch left in it; else why not, in words."""
    import torch

    if not _launches and not own_ran[0]:
        return None
    lo, hi = _extent(answer)
    for launch in reversed(_launches):
        for arg_name, t, kept in launch.tensors:
            a_lo, a_hi = _extent(t)
            if kept is None or not (a_lo <= lo and hi <= a_hi) or t.dtype != answer.dtype:
                continue
            if t.is_contiguous() and answer.is_contiguous():
                start = (lo - a_lo) // t.element_size()
                left = kept.reshape(-1)[start:start + answer.numel()].view(answer.shape)
            elif lo == a_lo and answer.shape == t.shape:
                left = kept
            else:
                continue
            if torch.equal(left.cpu(), answer.detach().cpu()) or torch.allclose(
                    left.cpu(), answer.detach().cpu(), equal_nan=True, rtol=0, atol=0):
                return None
            return (f"{name} changed after your kernel {launch.kernel} returned (it was its "
                    f"argument {arg_name}): the answer must be what the kernel wrote, not "
                    "computed around it")
    return (f"{name} was never handed to your kernel: allocate it, pass it to the kernel to "
            "write, and return it")


def triton_runs() -> bool:
    return BACKEND.uses_triton


def no_triton() -> str:
    """What a Triton exercise says where Triton does not run (``torch-reference``)."""
    return (f"this backend ({BACKEND.name}) runs no Triton, so your kernel cannot run here; "
            "start Jupyter with COURSE_BACKEND=triton-interpreter (or on a GPU) to check it")


@contextmanager
def recorded() -> Iterator[list[tuple[str, str]]]:
    """Within the block, every Triton launch appends ``(module, name)`` of its kernel to the
    yielded list. Outside a Triton backend the list stays empty."""
    kernels: list[tuple[str, str]] = []
    if not triton_runs():
        yield kernels
        return
    from triton.runtime.interpreter import InterpretedFunction, InterpreterBuilder
    from triton.runtime.jit import JITFunction

    originals = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}
    masked_load = InterpreterBuilder.create_masked_load
    masked_store = InterpreterBuilder.create_masked_store

    def spy(original):
        def run(self, *args, **kwargs):
            global _extents
            fn = getattr(self, "fn", None)
            kernel = (getattr(fn, "__module__", "?"), getattr(fn, "__name__", "?"))
            kernels.append(kernel)
            if kernel[0].startswith(COURSE_KERNELS) or _extents is not None:
                return original(self, *args, **kwargs)
            own_ran[0] = True
            named = _named_tensors(fn, args, kwargs)
            _extents = [(n, *_extent(t)) for n, t in named if t.device.type == "cpu"]
            try:
                result = original(self, *args, **kwargs)
            finally:
                _extents = None
            _launches.append(Launch(kernel[1], [
                (n, t, t.detach().clone() if t.numel() * t.element_size() <= SNAPSHOT_BYTES
                 else None) for n, t in named]))
            return result
        return run

    def check(ptrs, mask, verb: str) -> None:
        if _extents:
            import numpy as np

            width = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
            on = np.broadcast_to(mask.data.astype(bool), ptrs.data.shape)
            problem = _outside(ptrs.data[on].astype(np.int64), width, verb)
            if problem:
                raise OutOfBounds(problem)

    def checked_load(builder, ptrs, mask, other, *rest, **kw):
        check(ptrs, mask, "loaded")
        return masked_load(builder, ptrs, mask, other, *rest, **kw)

    def checked_store(builder, ptrs, value, mask, *rest, **kw):
        check(ptrs, mask, "stored")
        return masked_store(builder, ptrs, value, mask, *rest, **kw)

    for cls, original in originals.items():
        cls.run = spy(original)
    InterpreterBuilder.create_masked_load = checked_load
    InterpreterBuilder.create_masked_store = checked_store
    own_ran[0] = False
    new_case()
    try:
        yield kernels
    finally:
        for cls, original in originals.items():
            cls.run = original
        InterpreterBuilder.create_masked_load = masked_load
        InterpreterBuilder.create_masked_store = masked_store
        new_case()


def own(kernels: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The launched kernels that are not the course's (the learner's own, or a solution's)."""
    return [k for k in kernels if not k[0].startswith(COURSE_KERNELS)]


def not_a_kernel(kernels: list[tuple[str, str]]) -> str:
    """Why an answer that launched no kernel of its own fails a Triton exercise."""
    if kernels:
        names = ", ".join(sorted({f"{m}.{n}" for m, n in kernels}))
        return (f"your function launched only the course's kernels ({names}); this exercise "
                "asks you to write the @triton.jit kernel yourself")
    return ("your function launched no Triton kernel: the numbers may be right, but this "
            "exercise asks for a @triton.jit kernel launched as kernel[grid](...), not torch")

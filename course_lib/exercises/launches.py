"""Which Triton kernels a learner's answer launched.

A Triton exercise is about writing the kernel, so a checker must tell a ``@triton.jit`` kernel
from the same numbers computed in torch (or by the course's own kernels). Triton launches every
kernel through ``kernel[grid](...)``, which calls ``run`` on the kernel object: a
``JITFunction`` when compiled, an ``InterpretedFunction`` under ``TRITON_INTERPRET=1``
(``triton/runtime/jit.py``, ``triton/runtime/interpreter.py``, Triton 3.x). :func:`recorded`
wraps both ``run`` methods for the length of a check and notes each kernel's module and name;
an autotuned or heuristics-wrapped kernel reaches the same ``run`` underneath.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from course_lib.device import BACKEND

COURSE_KERNELS = "course_lib.kernels"   # the library's kernels: reading them is the last hint


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
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    originals = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}

    def spy(original):
        def run(self, *args, **kwargs):
            fn = getattr(self, "fn", None)
            kernels.append((getattr(fn, "__module__", "?"), getattr(fn, "__name__", "?")))
            return original(self, *args, **kwargs)
        return run

    for cls, original in originals.items():
        cls.run = spy(original)
    try:
        yield kernels
    finally:
        for cls, original in originals.items():
            cls.run = original


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

"""A kernel launch planned on the host, as plain data.

The wrappers (``paged_decode``, ``paged_prefill``) first *plan* their launches (grid, arguments,
compile-time constants, warps, stages) and then run them. The ahead-of-time check
(:mod:`course_lib.kernels.aot`) plans the same launches for tensors of realistic shapes on the
``meta`` device and compiles them through Triton's own argument binder: it compiles exactly
the kernel the JIT would build for that launch (same specialisations, same constants), without
a GPU.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Launch(NamedTuple):
    kernel: Any                # a triton JITFunction
    grid: tuple[int, ...]
    args: tuple                # positional arguments, in the kernel's order
    options: dict[str, Any]    # compile-time constants by name, num_warps, num_stages

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__

    def run(self) -> None:
        self.kernel[self.grid](*self.args, **self.options)

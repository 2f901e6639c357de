"""Which backend runs the course's kernels: the one place that decides.

* CUDA present            -> ``triton-cuda``: Triton compiles the kernels for the GPU.
* no CUDA, Triton present -> ``triton-interpreter``: ``TRITON_INTERPRET=1`` makes Triton run the
  same kernels in Python on CPU tensors (slow, so for small shapes, but every line is real).
* no Triton at all        -> ``torch-reference``: the plain torch functions the kernels are
  checked against.

``COURSE_BACKEND`` (``triton-cuda``, ``triton-interpreter`` or ``torch-reference``; unset or empty:
the automatic choice above) forces one, e.g. ``COURSE_BACKEND=torch-reference`` to run the course
without Triton where Triton is installed: no course_lib module then imports ``triton``. A choice
this machine cannot run (``triton-cuda`` without CUDA or with ``TRITON_INTERPRET=1``, a Triton
backend without Triton) or an unknown name raises ``ValueError`` when this module is imported.
``COURSE_BACKEND=triton-interpreter`` on a GPU machine is ``TRITON_INTERPRET=1``.

Triton reads ``TRITON_INTERPRET`` when it is imported and when a kernel is decorated, so the
variable must be set before anything imports ``triton``. Importing this module sets it; every
module of course_lib that uses Triton imports this module first, and so does each notebook's
first cell. CUDA is detected through torch, never by importing Triton. Setting
``TRITON_INTERPRET=1`` yourself forces the interpreter even on a GPU (useful for debugging).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
import warnings
from dataclasses import dataclass

TRITON_CUDA = "triton-cuda"
TRITON_INTERPRETER = "triton-interpreter"
TORCH_REFERENCE = "torch-reference"
BACKENDS = (TRITON_CUDA, TRITON_INTERPRETER, TORCH_REFERENCE)
ENV_VAR = "COURSE_BACKEND"


@dataclass(frozen=True)
class Backend:
    """What the kernels run on; decided once per process, when this module is imported."""

    name: str  # TRITON_CUDA | TRITON_INTERPRETER | TORCH_REFERENCE
    device: str  # "cuda" | "cpu": where kernel inputs should live
    torch_version: str
    triton_version: str | None  # None when Triton is not installed
    interpreted: bool  # True when Triton kernels run in Triton's interpreter
    # False only when this module had to set TRITON_INTERPRET=1 after triton was imported:
    # kernels decorated before that moment were built for a GPU and fail on CPU.
    interpret_set_in_time: bool = True
    forced: bool = False  # True when COURSE_BACKEND chose this backend

    @property
    def uses_triton(self) -> bool:
        return self.name != TORCH_REFERENCE

    def triton_runs_on(self, *where) -> bool:
        """Can the Triton kernels run on these tensors (or devices, or device names) here?
        Triton must be installed and they must live where it runs: CUDA when compiled, the
        CPU when interpreted. The fact every choice in ``course_lib.kernels`` asks."""
        import torch

        def device_type(w) -> str:
            return w.device.type if isinstance(w, torch.Tensor) else torch.device(w).type

        return self.uses_triton and all(device_type(w) == self.device for w in where)

    @property
    def gpu_name(self) -> str | None:
        """The GPU's name, or None on CPU. Asked lazily: it initialises CUDA, detection does not."""
        if self.device != "cuda":
            return None
        import torch

        return torch.cuda.get_device_name(0)

    def describe(self) -> str:
        """One line for people: backend, device and versions."""
        where = self.gpu_name or "CPU"
        triton = f"triton {self.triton_version}" if self.triton_version else "no triton"
        if self.triton_version and not self.uses_triton:
            triton += " not used"
        line = f"backend {self.name} on {where} (torch {self.torch_version}, {triton})"
        if self.forced:
            line += f"; chosen by {ENV_VAR}"
        if not self.interpret_set_in_time:
            line += "; TRITON_INTERPRET was set after triton was imported (see warning)"
        return line


def _triton_version() -> str | None:
    module = sys.modules.get("triton")
    if module is not None:
        return getattr(module, "__version__", None)
    for dist in ("triton", "pytorch-triton"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _triton_available() -> bool:
    # find_spec does not import the package; it returns None when sys.modules["triton"] is None,
    # which is how the tests simulate a machine without Triton.
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def _requested() -> str | None:
    """The backend ``COURSE_BACKEND`` names, or None when it is unset or empty."""
    value = os.environ.get(ENV_VAR, "").strip()
    if not value:
        return None
    if value not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={value!r} is not a backend: use one of "
                         f"{', '.join(BACKENDS)}, or leave it unset for the automatic choice")
    return value


def _check_possible(choice: str, cuda: bool, triton: bool) -> None:
    """Raise ``ValueError`` when this machine cannot run the backend ``COURSE_BACKEND`` chose."""
    why = None
    if choice != TORCH_REFERENCE and not triton:
        why = "Triton is not installed"
    elif choice == TRITON_CUDA and not cuda:
        why = "torch sees no CUDA device"
    elif choice == TRITON_CUDA and os.environ.get("TRITON_INTERPRET") == "1":
        why = "TRITON_INTERPRET=1 makes Triton interpret every kernel"
    if why:
        possible = [TRITON_INTERPRETER] if triton else []
        if triton and cuda and os.environ.get("TRITON_INTERPRET") != "1":
            possible.insert(0, TRITON_CUDA)
        possible.append(TORCH_REFERENCE)
        raise ValueError(f"{ENV_VAR}={choice!r} cannot run here: {why}. Valid values: "
                         f"{', '.join(BACKENDS)}; possible on this machine: "
                         f"{', '.join(possible)} (or leave {ENV_VAR} unset)")


def _detect() -> Backend:
    choice = _requested()  # an unknown name fails before torch is even imported
    import torch

    cuda = torch.cuda.is_available()  # does not initialise CUDA, so forking stays safe
    triton = _triton_available()
    if choice is not None:
        _check_possible(choice, cuda, triton)
    common = dict(device="cuda" if cuda else "cpu", torch_version=torch.__version__.split("+")[0],
                  forced=choice is not None)

    if choice == TORCH_REFERENCE or not triton:
        version = _triton_version() if triton else None  # read from metadata: nothing imported
        return Backend(TORCH_REFERENCE, triton_version=version, interpreted=False, **common)

    already_set = os.environ.get("TRITON_INTERPRET") == "1"
    if cuda and not already_set and choice != TRITON_INTERPRETER:
        return Backend(TRITON_CUDA, triton_version=_triton_version(), interpreted=False, **common)

    in_time = already_set or sys.modules.get("triton") is None
    if not in_time:
        warnings.warn(
            "triton was imported before course_lib.device could set TRITON_INTERPRET=1: "
            "Triton kernels defined before this point were built for a GPU and will fail on CPU. "
            "Restart the Python process (or notebook kernel) and import course_lib.device first.",
            RuntimeWarning,
            stacklevel=2,
        )
    os.environ["TRITON_INTERPRET"] = "1"
    return Backend(TRITON_INTERPRETER, triton_version=_triton_version(), interpreted=True,
                   interpret_set_in_time=in_time, **common)


BACKEND: Backend = _detect()


def backend() -> Backend:
    """The backend this process runs on (decided at import)."""
    return BACKEND


def describe() -> str:
    """One human line, e.g. ``backend triton-interpreter on CPU (torch 2.13.0, triton 3.7.1)``."""
    return BACKEND.describe()

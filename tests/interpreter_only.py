"""A mark for the tests that run deliberately wrong Triton kernels, or that read what only
Triton's interpreter shows (course_lib/exercises/launches.py checks every load and store of a
learner's kernel there, before it touches memory). Compiled on a GPU, an unmasked load is not
seen and an out-of-bounds store faults the CUDA context, failing every later test of the
process: those tests are skipped where Triton compiles the kernels (they run on the course's
CPU path, and in CI)."""

import pytest

from course_lib.device import BACKEND

INTERPRETER_ONLY = pytest.mark.skipif(
    BACKEND.uses_triton and not BACKEND.interpreted,
    reason="wrong Triton kernels are judged by the interpreter's load and store checks; "
           "compiled on a GPU an out-of-bounds store faults the CUDA context")

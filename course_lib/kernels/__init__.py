"""Kernels of the course: a torch reference (the spec) and Triton kernels checked against it.

Each kernel module imports :mod:`course_lib.device` before ``triton``, so that on a machine
without CUDA Triton's interpreter is switched on in time. Submodules load on demand.
"""

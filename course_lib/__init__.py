"""course_lib: the paged KV-cache system that the paged-kv-course notebooks build.

Each chapter writes a toy version of one part in the notebook, then runs this library on the
same input. Submodules are imported on demand: ``course_lib.memory`` is pure Python, and only
``course_lib.device`` and the kernels import torch and Triton, so nothing heavy loads here.
"""

__version__ = "0.1.0"

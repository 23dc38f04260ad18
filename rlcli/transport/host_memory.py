"""Host memory of the CPU compute processes: freed memory stays in the heap for the next step.

glibc's malloc serves a request above its mmap threshold (which grows with use, but at most
32 MiB) with fresh pages from ``mmap`` and unmaps them on ``free``. A training step on a CPU
allocates several such temporaries (the loss tokens' ``[tokens, vocab]`` logits and their
gradient, the tied embedding's gradients) and a decode step one (the sampler's float64 CDF
over the vocabulary), so every step touches new pages: each is a page fault the kernel
zero-fills. On the SmolLM2 recipe of issue #15 that was ~200k faults and ~0.45 s of system
time per trainer step (~6% of it) and ~0.6 s per engine generation of one RL step (~10%).

:func:`keep_freed_memory` sets ``M_MMAP_MAX`` to 0 (every request from the heap) and
``M_TRIM_THRESHOLD`` to 2 GiB (the heap is not shrunk below that much free memory), so a
step's temporaries reuse the pages of the step before. The cost: the process keeps the heap
it grew to. It changes where memory comes from, never a computed value. rl-train and rl-infer
call it when they compute on the CPU; on a libc without ``mallopt`` it does nothing.
"""

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Serve every allocation from the heap and keep freed memory there (module docstring).
    Returns whether the C library took both settings."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))

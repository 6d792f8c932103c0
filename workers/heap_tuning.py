"""glibc malloc settings for a worker process: a step's large host temporaries reuse the heap's pages.

A CPU step allocates and frees the same large tensors every step: the sampled rows' logits, their copies with
logit_bias applied, the softmax and the sampling noise (0.2-1 MB each with a 49k vocabulary). With glibc's defaults
the freed top of the heap is handed back to the kernel once it exceeds the trim threshold (a few times the largest
block freed so far), so the next step faults every page in again: with 2 sampled rows and a logit_bias that cost
~0.85 ms a step (~1.3 ms against ~0.45 ms for the sampler, one thread), which every other request in the batch waited
for. Fixed thresholds keep blocks up to glibc's largest mmap threshold on the heap and keep up to
`TRIM_THRESHOLD_BYTES` of freed heap mapped; a prefill's larger buffers are still mapped and unmapped as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD_BYTES = 128 << 20  # freed heap kept mapped: bounds what an idle worker holds beyond its peak


def keep_step_temporaries_on_heap() -> bool:
    """Set the worker's malloc thresholds; False where the C library is not glibc (nothing changed)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): its allocator keeps its own policy
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )

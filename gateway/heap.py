"""The C heap of a long-lived gateway process: freed memory is kept for the next burst instead of being handed
back to the kernel after each one.

Bodies over pymalloc's 512 bytes come from the C library's malloc: a streamed answer's chunk, a request body,
a JSON reply. With glibc's defaults, once the top of the heap holds more than 128 KiB free it is given back
(`brk`), and the next burst takes it again, each page faulted in on first touch. Whether that happens on every
burst depends on which object happens to sit at the heap's top: on the benchmark, 64 streams after a spell of
plain requests cost 5-8% more CPU per stream in one tree than in another for no other reason, all of it in
`brk`, page faults and the first copy into fresh pages (docs/benchmarks.md). Settings that do not depend on
luck: keep up to 64 MiB free at the top, grow it 16 MiB at a time, and serve blocks up to 4 MiB from the heap
(larger ones are mapped and unmapped on their own, as a huge upload should be).

An operator's own `MALLOC_*_` variable wins over each setting; off glibc (musl has no such knobs) nothing is
done."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's <malloc.h>
MiB = 1 << 20
SETTINGS = (  # (mallopt's parameter, the environment variable glibc reads for it, the gateway's value)
    (M_TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_", 64 * MiB),
    (M_TOP_PAD, "MALLOC_TOP_PAD_", 16 * MiB),
    (M_MMAP_THRESHOLD, "MALLOC_MMAP_THRESHOLD_", 4 * MiB),
)


def keep_freed_heap(environ: Mapping[str, str] = os.environ) -> dict[str, int]:
    """Apply SETTINGS that the environment leaves unset; returns those applied, by variable name (empty where
    the C library has no `mallopt`)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return {}
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = {}
    for param, variable, value in SETTINGS:
        if variable not in environ and mallopt(param, value) == 1:  # 1: done; 0: refused
            applied[variable] = value
    return applied

"""On a CPU, keep the memory one training step frees for the next.

glibc serves every block of 32 MiB or more (and smaller ones once its dynamic threshold is passed) with a
fresh mapping and unmaps it when freed, so a step's logits, a large vocabulary's gradients and every other
big tensor are faulted in and zeroed by the kernel again at every step: on the 2-core VM of this project a full
fine-tuning step of Llama-3.2-1B (two layers, 2 × 128 tokens) faulted 4.1 GB and ran 2.2× slower than with the
memory kept (benchmarks/cpu_freed_memory.py), and the cost moved several-fold with how soon the hypervisor
reclaimed the freed pages. With mmap off and trimming off (`mallopt`), freed blocks stay in the heap and the
next step reuses them: after the first steps nothing faults, as on a GPU, whose caching allocator does the same.

The price is resident memory: it stays at the heap's high-water mark, which fragmentation puts above the live
peak (+5% and +34% in that benchmark's two cases). A user who set glibc's malloc tuning in the environment
(`MALLOC_MMAP_THRESHOLD_=65536` makes resident memory follow live memory, as the memory checks run) keeps it.
"""

from __future__ import annotations

import ctypes
import os
import sys

# mallopt parameter numbers from glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
# The variables by which a user tunes glibc's allocator; any of them set leaves it as they chose.
MALLOC_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_MAX_", "MALLOC_TOP_PAD_",
                    "MALLOC_ARENA_MAX")


def user_tuned_malloc() -> bool:
    return (any(name in os.environ for name in MALLOC_VARIABLES)
            or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""))


def untuned_environment() -> dict[str, str]:
    """This process's environment without the allocator tuning `user_tuned_malloc` looks for: a child started
    with it keeps freed memory when it calls `keep_freed_memory`."""
    return {name: value for name, value in os.environ.items()
            if name not in MALLOC_VARIABLES and not (name == "GLIBC_TUNABLES" and "glibc.malloc." in value)}


def keep_freed_memory() -> bool:
    """Make glibc keep freed blocks for reuse (no mmap, no trimming); True when it took effect. Not on other C
    libraries or systems, and not where the user tuned glibc's allocator themselves."""
    if not sys.platform.startswith("linux") or user_tuned_malloc():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    # glibc takes the threshold as a size_t: -1 is "never trim"
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, -1))


def peak_rss_gib() -> float:
    """This process's peak resident memory: the kernel's high-water mark (VmHWM), which reset_peak_rss moves
    down to the present; ru_maxrss where /proc is not there."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / 2**30
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30


def reset_peak_rss() -> bool:
    """Start the high-water mark afresh from the present (Linux `clear_refs` 5), so that the peak of the
    training steps is not that of loading: under FSDP2 each rank builds the whole model before its shard is
    kept. False where the kernel does not offer it."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        return False
    return True

"""On a CPU the runner keeps the memory a step frees: a block freed and allocated again is not faulted in
again, unless the user tuned glibc's allocator, whose choice is kept."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tunecast.train.host_memory import untuned_environment

# Allocate, write and free a 256 MiB block twice; report the page faults of the second round.
CHILD = """
import ctypes, json, resource, sys
from tunecast.train.host_memory import keep_freed_memory
kept = keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
size = 256 << 20
faults = []
for _ in range(2):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"kept": kept, "faults": faults}))
"""
PAGES = (256 << 20) // 4096


def faults_of(extra_env: dict[str, str]) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD], env={**untuned_environment(), **extra_env},
                          capture_output=True, text=True, timeout=60, check=True)
    return json.loads(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_a_freed_block_is_reused_without_faulting_again() -> None:
    result = faults_of({})
    assert result["kept"] is True
    first, second = result["faults"]
    assert first >= PAGES // 2  # the first write faults its pages in
    assert second < PAGES // 100  # the second finds them in the heap


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_the_users_malloc_tuning_is_kept() -> None:
    result = faults_of({"MALLOC_MMAP_THRESHOLD_": "65536"})
    assert result["kept"] is False
    assert min(result["faults"]) >= PAGES // 2  # mapped afresh, faulted in again, as glibc does by default

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


def test_loading_counts_the_tensors_stored_in_another_dtype(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import torch
    from safetensors.torch import save_file

    from tunecast.train.host_memory import loading_bytes, weight_files

    save_file({"a": torch.zeros(100, dtype=torch.bfloat16), "b": torch.zeros(10, dtype=torch.float32)},
              str(tmp_path / "model.safetensors"))
    files = weight_files(tmp_path)
    assert files == [tmp_path / "model.safetensors"]
    assert loading_bytes(files, "bfloat16") == 40  # b, converted
    assert loading_bytes(files, "float32") == 200  # a, converted
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 16)  # damaged: loading it says so, not the estimate
    assert loading_bytes(files, "float32") == 0


def test_the_check_returns_freed_memory_when_keeping_it_would_not_fit(monkeypatch, shared_cache) -> None:  # type: ignore[no-untyped-def]
    """On the CPU the check predicts the process's growth: with freed memory kept, the kept heap above the live
    estimate; a shape that fits only without it runs with freed memory returned to the system."""
    from tests.trainruns import TINY_MODEL

    from tunecast.catalog.store import load_catalog
    from tunecast.config.spec import RunSpec
    from tunecast.train.batching import Device, choose_batch

    monkeypatch.setenv("TUNECAST_CACHE", str(shared_cache))
    catalog = load_catalog(None)
    spec = RunSpec.model_validate({"model": str(TINY_MODEL), "micro_batch": 2, "seq_len": 128, "precision": "fp32",
                                   "plan": {"memory_margin": 0.0}})
    data = json.loads((TINY_MODEL / "config.json").read_text())
    live = choose_batch(spec, data, Device("cpu", "the CPU", 100.0, None), catalog).estimate_gib
    roomy = choose_batch(spec, data, Device("cpu", "the CPU", 100.0, None), catalog, keep_freed=True)
    assert roomy.keep_freed_memory and roomy.estimate_gib is not None and live is not None
    assert roomy.estimate_gib > live and "of freed memory kept for speed" in roomy.reasons[0]

    tight = choose_batch(spec, data, Device("cpu", "the CPU", (live + roomy.estimate_gib) / 2, None), catalog,
                         keep_freed=True)
    assert not tight.keep_freed_memory and tight.estimate_gib == pytest.approx(live)
    assert "with freed memory returned to the system (slower steps)" in tight.reasons[0]

    loading = choose_batch(spec, data, Device("cpu", "the CPU", 100.0, None), catalog, loading_gib=50.0)
    assert loading.estimate_gib is not None and loading.estimate_gib > 50.0 and "loading" in loading.reasons[0]

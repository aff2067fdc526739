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

What the memory check before a CPU run adds to the live estimate (`tunecast memory --device cpu`), so that it
does not under-predict the process's growth (batching.py):

* kept freed memory: the heap's high-water mark climbs over the first steps (blocks one step frees are not
  reused whole by the next) and settles within about six steps, up to KEPT_HEAP_FACTOR × what a step allocates
  and frees (the live peak less the weights, trainable weights and optimizer states) above the live peak: the
  heap may hold another copy of it, and a little more. An envelope of the cases benchmarks/cpu_kept_memory.py
  measures (0.22 to 0.95 of it; docs/benchmarks/cpu-kept-memory.md). When that does not fit but the live peak
  does, the run returns freed memory to the system instead (slower steps, resident memory that follows live
  memory);
* loading: weights stored in another dtype than the run's are converted as they load, the file's pages
  (mapped) and the converted copy resident together (`loading_bytes`); weights stored in the run's dtype are
  used from the mapped file, with no copy.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from pathlib import Path
from typing import Any

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


def can_keep_freed_memory() -> bool:
    """Whether keep_freed_memory would act here: Linux, and the user did not tune glibc's allocator."""
    return sys.platform.startswith("linux") and not user_tuned_malloc()


def keep_freed_memory() -> bool:
    """Make glibc keep freed blocks for reuse (no mmap, no trimming); True when it took effect. Not on other C
    libraries or systems, and not where the user tuned glibc's allocator themselves."""
    if not can_keep_freed_memory():
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


# The heap's high-water mark above the live peak with freed memory kept, per byte a step allocates and frees:
# 0.22 to 0.95 measured after six steps (benchmarks/cpu_kept_memory.py), the same case 0.54 and 0.95 in two runs;
# a quarter above the largest leaves room for that spread.
KEPT_HEAP_FACTOR = 1.25

# safetensors' dtype names, by torch's
SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def kept_heap_gib(transient_gib: float) -> float:
    """Resident memory above the live peak when the runner keeps freed memory (keep_freed_memory), for a step that
    allocates and frees `transient_gib` (its live peak less the weights, trainable weights and optimizer states)."""
    return KEPT_HEAP_FACTOR * transient_gib


def weight_files(folder: Path) -> list[Path]:
    """The weight files of a model folder: the safetensors or PyTorch files its index names, or the single file."""
    for index, single in (("model.safetensors.index.json", "model.safetensors"),
                          ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        if (folder / index).exists():
            names = json.loads((folder / index).read_text()).get("weight_map", {}).values()
            return [folder / name for name in sorted(set(names))]
        if (folder / single).exists():
            return [folder / single]
    return []


def loading_bytes(files: list[Path], dtype_name: str) -> int:
    """Bytes of the weight files resident while they load in `dtype_name` (torch's name) besides the model itself:
    the tensors stored in another dtype, whose mapped pages stay resident while each is converted (transformers
    loads the whole file before it lets go of it). A PyTorch `.bin` file is read whole: all of it."""
    wanted = SAFETENSORS_DTYPES.get(dtype_name)
    total = 0
    for path in files:
        if path.suffix != ".safetensors":
            total += path.stat().st_size
            continue
        try:
            with open(path, "rb") as handle:
                length = int.from_bytes(handle.read(8), "little")
                header = json.loads(handle.read(min(length, 100_000_000)))
            total += sum(entry["data_offsets"][1] - entry["data_offsets"][0] for name, entry in header.items()
                         if name != "__metadata__" and entry.get("dtype") != wanted)
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
            continue  # a damaged file: loading it says so (model.py)
    return total


def cpu_loading_gib(spec: Any, resolved: Any) -> float:
    """What loading the weights holds on the CPU besides the model: the files' tensors stored in another dtype than
    the run's (host_memory.loading_bytes), for a model folder or a model in the local Hugging Face cache."""
    from tunecast.step.setup import compute_dtype, param_dtype

    folder = resolved.path.parent if resolved.origin == "directory" else (
        _cached_folder(resolved.name) if resolved.origin in ("catalog", "downloaded") else None)
    files = weight_files(folder) if folder is not None else []  # none: random weights, drawn in the run's dtype
    dtype = compute_dtype(spec.precision) if spec.method == "qlora" else param_dtype(spec.precision)
    return loading_bytes(files, str(dtype).removeprefix("torch.")) / 2**30


def _cached_folder(name: str) -> Any:
    """The local snapshot folder of a Hub model whose weights are in the Hugging Face cache, else None."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    for file in ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json",
                 "pytorch_model.bin"):
        found = try_to_load_from_cache(name, file)
        if isinstance(found, str):
            return Path(found).parent
    return None

"""Bit-exact resume needs kernels that give the same bits for the same inputs.

On the CPU, torch's own parallel loops split work by a fixed thread count, but Intel MKL (torch's BLAS on
x86) by default picks its thread count per call from the machine's load (`MKL_DYNAMIC=TRUE`), so a matmul
on a busy machine can sum in another order and differ in the last bit — enough to make two runs of the same
config drift apart. `tunecast train` turns that off before MKL loads. On CUDA, kernels that use atomics
(some cuBLAS and attention backward paths) are not reproducible either; see docs/train.md.
"""

from __future__ import annotations

import os


def fix_cpu_threads() -> None:
    """MKL uses the thread count it is given, whatever the load (unless the user set MKL_DYNAMIC)."""
    os.environ.setdefault("MKL_DYNAMIC", "FALSE")

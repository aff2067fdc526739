"""One worker of `tunecast probe --collectives` (`python -m tunecast.plan.collective_worker`, started by
plan/collectives.py with torchrun's rank variables): joins the process group, times each collective at each
message size, and rank 0 writes the times as JSON. What is measured and why: plan/collectives.py.

Every rank takes every decision from figures all ranks share (the slowest rank's warm-up time, all-reduced), so
that all of them call the same collectives the same number of times: a rank that decided alone would leave the
others waiting in a collective it never joins.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tunecast.atomic import write_text_atomic
from tunecast.catalog.devices import COLLECTIVES

ROUNDS = 7  # timed rounds of each collective and size; the median counts (a round that lost its core is slower)
ROUND_S = {"cpu": 0.02, "cuda": 0.005}  # the least time one round covers: back-to-back calls until then
MAX_CALLS = 200  # calls in one round at most
# A size whose warm-up call takes longer ends that collective's sweep: the larger ones would take longer still,
# and the sizes already timed cover the bandwidth.
LONGEST_CALL_S = 0.5
ELEMENT_BYTES = 4  # fp32


def _gather(output: torch.Tensor, shard: torch.Tensor) -> None:
    # all_gather_single is torch 2.13's name for all_gather_into_tensor (deprecated there)
    (dist.all_gather_single if hasattr(dist, "all_gather_single") else dist.all_gather_into_tensor)(output, shard)


def _scatter(output: torch.Tensor, whole: torch.Tensor) -> None:
    # reduce_scatter_single is torch 2.13's name for reduce_scatter_tensor (deprecated there)
    (dist.reduce_scatter_single if hasattr(dist, "reduce_scatter_single") else dist.reduce_scatter_tensor)(
        output, whole)


def _call(collective: str, size_bytes: int, processes: int, device: torch.device) -> Callable[[], None]:
    """One call of `collective` on a message of `size_bytes` (nccl-tests' size: the whole array — all-reduce's
    buffer, all-gather's output, reduce-scatter's input), its tensors allocated once."""
    numel = size_bytes // ELEMENT_BYTES
    if collective == "all_reduce":
        buffer = torch.ones(numel, device=device)
        return lambda: dist.all_reduce(buffer)
    whole = torch.ones(numel, device=device)
    shard = torch.ones(numel // processes, device=device)
    if collective == "all_gather":
        return lambda: _gather(whole, shard)
    return lambda: _scatter(shard, whole)


class Timer:
    """Seconds of a call on every rank's clock, the slowest rank's: CUDA work synchronized before and after."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cell = torch.zeros(1, dtype=torch.float64, device=device)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def slowest(self, seconds: float) -> float:
        """The largest of every rank's `seconds` (a collective itself, so also a barrier)."""
        self.cell.fill_(seconds)
        dist.all_reduce(self.cell, op=dist.ReduceOp.MAX)
        return float(self.cell.item())

    def once(self, call: Callable[[], None], times: int = 1) -> float:
        self._sync()
        started = time.perf_counter()
        for _ in range(times):
            call()
        self._sync()
        return (time.perf_counter() - started) / times


def measure(collective: str, size_bytes: int, processes: int, timer: Timer) -> float | None:
    """Seconds per call of `collective` at `size_bytes` (the median round, the slowest rank's), or None when its
    warm-up call took over LONGEST_CALL_S."""
    call = _call(collective, size_bytes, processes, timer.device)
    call()  # the first call sets up the connections and buffers of this shape
    warm = timer.slowest(timer.once(call))
    if warm > LONGEST_CALL_S:
        return None
    calls = max(1, min(MAX_CALLS, math.ceil(ROUND_S[timer.device.type] / max(warm, 1e-7))))
    rounds = []
    for _ in range(ROUNDS):
        timer.slowest(0.0)  # every rank starts the round together
        rounds.append(timer.once(call, calls))
    return timer.slowest(statistics.median(rounds))


def message_sizes(sizes: Sequence[int], processes: int) -> list[int]:
    """The sizes, each rounded down to a whole number of fp32 values per process (a shard each)."""
    unit = ELEMENT_BYTES * processes
    return [max(unit, size // unit * unit) for size in sizes]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tunecast.plan.collective_worker")
    parser.add_argument("--device", choices=("cpu", "cuda"), required=True)
    parser.add_argument("--sizes", required=True, help="message sizes in bytes, comma-separated")
    parser.add_argument("--out", type=Path, required=True, help="where rank 0 writes the times (JSON)")
    parser.add_argument("--timeout-s", type=float, required=True, help="joining and each collective, at most")
    args = parser.parse_args(argv)
    rank, processes = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timedelta(seconds=args.timeout_s), device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout_s))
    timer = Timer(device)
    times = []
    for collective in COLLECTIVES:
        for size in message_sizes([int(size) for size in args.sizes.split(",")], processes):
            seconds = measure(collective, size, processes, timer)
            if seconds is None:
                break
            times.append({"collective": collective, "bytes": size, "seconds": seconds})
    if rank == 0:
        document = {"backend": dist.get_backend(), "processes": processes, "dtype": "fp32", "times": times}
        write_text_atomic(args.out, json.dumps(document))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

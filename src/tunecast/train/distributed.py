"""One process or several: the ranks of a run, how the model is spread over them, and what they agree on.

tunecast has no distributed engine of its own. A run started by `torchrun`, `accelerate launch` or
`tunecast train --gpus N` (launch/local.py) finds its rank in the environment those launchers set (`RANK`,
`WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`), joins a torch process group (NCCL on GPUs, gloo on
the CPU) and spreads the model with torch's own wrappers, as the plan chose (`gpus.strategy`):

* `ddp`: a whole replica per rank, gradients averaged by `DistributedDataParallel`;
* `fsdp`: FSDP2 (`fully_shard`) on every decoder layer and on the whole model, parameters,
  gradients and optimizer states sharded, each layer gathered for its forward and backward;
* `fsdp-grad-op`: FSDP2 with `reshard_after_forward=False` (gradients and optimizer states sharded, parameters
  kept gathered between the passes of a step);
* `gpus.offload`: FSDP2's CPU offload of parameters, gradients and optimizer step (GPUs only).

What the ranks must agree on is decided collectively, at points every rank passes the same number of times:
whether to stop (a preemption signal seen by any rank stops them all, at the same micro-step), whether a
checkpoint is due (a time-based interval is read on every rank's clock), the batch shape (rank 0 chooses,
the others receive it). A collective whose peer is gone (a rank killed, a machine lost) fails with gloo and
NCCL errors, or after `TUNECAST_DIST_TIMEOUT_S` (1800 s) of silence — long, since rank 0 alone verifies and
writes some files while the others wait; the survivors then stop with the
preemption status and no new checkpoint, so the newest complete one is where the run resumes.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch

from tunecast.errors import TunecastError
from tunecast.train.signals import Preempted, PreemptionFlag
from tunecast.train.world import World

DEFAULT_TIMEOUT_S = 1800.0  # a hung peer only (a dead one fails at once); rank 0 alone verifies checkpoints


class PeerLost(Exception):
    """A collective failed: another rank died or stopped answering."""


def timeout_s() -> float:
    value = os.environ.get("TUNECAST_DIST_TIMEOUT_S")
    return float(value) if value else DEFAULT_TIMEOUT_S


class Engine:
    """The run's processes as one: the device of this rank, the model wrapper, and the collectives the loop
    needs. With one process every collective is the identity and the model is left as it is."""

    def __init__(self, world: World, device: torch.device) -> None:
        self.world = world
        self.device = device
        self.strategy = "single"
        self._group_device = device  # collectives run on this device (NCCL: the GPU; gloo: the CPU)

    @classmethod
    def start(cls, world: World) -> Engine:
        """Join the process group of `world` (when it has more than one process) on this rank's device."""
        cuda = torch.cuda.is_available()
        device = torch.device("cuda", world.local_rank) if cuda else torch.device("cpu")
        if world.distributed:
            import torch.distributed as dist

            if not cuda and "OMP_NUM_THREADS" not in os.environ:  # CPU ranks of one machine share its cores
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // world.local_size))
            if cuda and world.local_rank >= torch.cuda.device_count():
                raise TunecastError(f"rank {world.rank} has no GPU of its own: this machine has "
                                    f"{torch.cuda.device_count()}", field="gpus.count",
                                    hint="start at most one process per GPU (--gpus, gpus.count)")
            if not dist.is_initialized():
                try:
                    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s()))
                except (RuntimeError, ValueError) as error:
                    raise TunecastError(f"rank {world.rank} of {world.size} could not join the others: {error}",
                                        field="MASTER_ADDR",
                                        hint="check MASTER_ADDR / MASTER_PORT and that every rank was started"
                                        ) from None
        if cuda:
            torch.cuda.set_device(device)
        return cls(world, device)

    def close(self) -> None:
        if self.world.distributed:
            import torch.distributed as dist

            if dist.is_initialized():
                with contextlib.suppress(RuntimeError):
                    dist.destroy_process_group()

    # --- the model -------------------------------------------------------------------------------------

    def wrap(self, model: Any, *, strategy: str, offload: str, layers: list[torch.nn.Module]) -> Any:
        """`model` spread over the ranks by `strategy`; unchanged with one process."""
        if not self.world.distributed:
            return model
        self.strategy = strategy
        if strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            with self._collective():  # the constructor broadcasts rank 0's parameters
                return DistributedDataParallel(model, device_ids=ids)
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        policy: OffloadPolicy = CPUOffloadPolicy() if offload != "none" and self.device.type == "cuda" \
            else OffloadPolicy()
        reshard = strategy != "fsdp-grad-op"
        for layer in layers:
            fully_shard(layer, reshard_after_forward=reshard, offload_policy=policy)
        fully_shard(model, reshard_after_forward=reshard, offload_policy=policy)
        return model

    @property
    def sharded(self) -> bool:
        return self.strategy in ("fsdp", "fsdp-grad-op")

    def unwrap(self, model: Any) -> Any:
        """The model without its DDP wrapper (FSDP2 shards the module in place: it is the same object)."""
        return model.module if self.strategy == "ddp" else model

    def accumulating(self, model: Any, last: bool) -> contextlib.AbstractContextManager[Any]:
        """Around one micro-batch's passes: DDP skips the gradient all-reduce on all but the step's last one.
        FSDP2 reduce-scatters every micro-batch, keeping gradients sharded, as the memory estimate assumes."""
        if self.strategy == "ddp" and not last:
            return model.no_sync()
        return contextlib.nullcontext()

    # --- collectives -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _collective(self) -> Iterator[None]:
        try:
            yield
        except (RuntimeError, OSError) as error:  # gloo and NCCL report a lost peer as these
            raise PeerLost(str(error).splitlines()[0] if str(error) else type(error).__name__) from None

    def check(self, flag: PreemptionFlag) -> None:
        """Raise Preempted on every rank when any rank received a preemption signal."""
        if not self.world.distributed:
            flag.check()
            return
        mine = signal.Signals[flag.received].value if flag.received else 0
        (seen,) = self.reduce_max([float(mine)])
        if seen:
            name = flag.received or f"{signal.Signals(int(seen)).name} (on another rank)"
            raise Preempted(name)

    def reduce_max(self, values: list[float]) -> list[float]:
        return self._reduce(values, "max")

    def reduce_sum(self, values: list[float]) -> list[float]:
        return self._reduce(values, "sum")

    def _reduce(self, values: list[float], how: str) -> list[float]:
        if not self.world.distributed:
            return list(values)
        import torch.distributed as dist

        tensor = torch.tensor(values, dtype=torch.float64, device=self._group_device)
        with self._collective():
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX if how == "max" else dist.ReduceOp.SUM)
        return [float(v) for v in tensor.cpu().tolist()]

    def broadcast(self, value: Any) -> Any:
        """Rank 0's `value` on every rank."""
        if not self.world.distributed:
            return value
        import torch.distributed as dist

        box = [value]
        with self._collective():
            dist.broadcast_object_list(box, src=0, device=self._group_device)
        return box[0]

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order, on every rank."""
        if not self.world.distributed:
            return [value]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world.size
        with self._collective():
            dist.all_gather_object(out, value)
        return out

    def barrier(self) -> None:
        if self.world.distributed:
            import torch.distributed as dist

            with self._collective():
                if self._group_device.type == "cuda":
                    dist.barrier(device_ids=[self._group_device.index])
                else:
                    dist.barrier()

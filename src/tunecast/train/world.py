"""Where this process stands among the run's processes, read from the variables a launcher sets (torchrun,
accelerate launch, `tunecast train --gpus N`). Without torch: the CLI reads it before the libraries load.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tunecast.errors import TunecastError


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise TunecastError(f"the environment variable {name} is {value!r}, not a number", field=name,
                            hint="start the run with torchrun, accelerate launch or tunecast train --gpus N, "
                                 "which set it") from None


@dataclass(frozen=True)
class World:
    """Where this process stands among the run's processes."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    launched: bool = False  # started by a launcher (even as its only process: torchrun --nproc_per_node 1)
    local_size: int = 1  # processes of the run on this machine (they share its cores and, on a CPU, its memory)

    @property
    def distributed(self) -> bool:
        """A process group and the strategy's wrapper: several processes, or one that a launcher started."""
        return self.size > 1 or self.launched

    @property
    def main(self) -> bool:
        return self.rank == 0


def world_from_env() -> World:
    """The rank and world size a launcher set (torchrun, accelerate launch, tunecast's own); one process
    when none did."""
    size = _env_int("WORLD_SIZE")
    if size is None or size < 1 or "MASTER_ADDR" not in os.environ:
        return World()
    rank = _env_int("RANK")
    if rank is None or not 0 <= rank < size:
        raise TunecastError(f"WORLD_SIZE is {size} but RANK is {os.environ.get('RANK')!r}", field="RANK",
                            hint="start the run with torchrun, accelerate launch or tunecast train --gpus N")
    local = _env_int("LOCAL_RANK")
    here = _env_int("LOCAL_WORLD_SIZE")
    return World(rank, size, local if local is not None else rank, launched=True,
                 local_size=here if here is not None else size)

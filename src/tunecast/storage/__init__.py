"""Storage that outlives the machine: run outputs and checkpoints on any fsspec filesystem, and one writer per run."""

"""A simulation of PyTorch's CUDA caching allocator, replaying a trace's allocations and frees.

`torch.cuda.max_memory_allocated` counts blocks rounded up to 512 bytes; `max_memory_reserved` counts the
segments the allocator obtained from cudaMalloc, which it keeps and reuses instead of returning. Which
segments exist depends on the order and sizes of every allocation, so this replays them with the rules of
c10/cuda/CUDACachingAllocator.cpp (default configuration, one stream):

* sizes round up to a multiple of 512 bytes (kMinBlockSize);
* requests up to 1 MiB (kSmallSize) come from a small pool of 2 MiB segments (kSmallBuffer); larger ones
  from a large pool, whose new segments are 20 MiB (kLargeBuffer) for requests under 10 MiB
  (kMinLargeAlloc) and the request rounded up to 2 MiB (kRoundLarge) above that;
* a request takes the smallest free block of its pool that fits (ties: lowest address) and splits it
  when the remainder is at least 512 bytes (small pool) or more than 1 MiB (large pool);
* a freed block merges with free neighbours of its segment; segments are never released (no OOM retry
  and no `empty_cache` in a training step that fits).

At the edge: when cudaMalloc fails, the allocator frees every cached segment that holds no allocated block and
tries again (`release_cached_blocks`, then one more cudaMalloc; only then out of memory). Segments that hold a live
block cannot be given back. So besides what it reserves when memory is plentiful (`peak_reserved`), the replay
keeps what the process must hold at least: the largest total, over the step, of the segments that hold a live block
(`peak_pinned`). A device with at least that much (and the context) runs the step, releasing cache where it must.

Not modelled: `expandable_segments` (tunecast's runner does not set it), `max_split_size_mb`, and how the placement
of later blocks changes after a release (the segments obtained afterwards fit their requests more tightly).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def round_size(nbytes: int) -> int:
    """The block size the allocator hands out (and counts as allocated) for a request of `nbytes`."""
    if nbytes < MIN_BLOCK:
        return MIN_BLOCK
    return -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int) -> int:
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(slots=True)
class _Block:
    address: int
    size: int
    small: bool
    free: bool = True
    prev: _Block | None = None
    next: _Block | None = None


@dataclass
class CachingAllocator:
    """Replays malloc/free; `reserved` and `peak_reserved` are what torch.cuda would report.

    A replay calls it a million times for a cold plan: the rules above, written for speed (each pool a list of
    (size, address) kept sorted, so that the best fit is the first at or above the size)."""

    reserved: int = 0
    peak_reserved: int = 0
    allocated: int = 0
    peak_allocated: int = 0
    pinned: int = 0  # bytes of the segments that hold at least one allocated block
    peak_pinned: int = 0
    _small: list[tuple[int, int]] = field(default_factory=list)  # free blocks of the small pool
    _large: list[tuple[int, int]] = field(default_factory=list)
    _by_address: dict[int, _Block] = field(default_factory=dict)
    _next_address: int = 0

    def malloc(self, nbytes: int) -> int:
        """Allocate; returns the block's address, the handle for `free`."""
        size = MIN_BLOCK if nbytes < MIN_BLOCK else -(-nbytes // MIN_BLOCK) * MIN_BLOCK  # round_size
        small = size <= SMALL_SIZE
        pool = self._small if small else self._large
        index = bisect.bisect_left(pool, (size, -1))
        if index < len(pool):
            block = self._by_address[pool.pop(index)[1]]
            if block.prev is None and block.next is None:  # a whole segment, free until now
                self.pinned += block.size
        else:
            block = self._new_segment(segment_size(size), small)
            self.pinned += block.size
        remainder = block.size - size
        if remainder >= MIN_BLOCK if small else remainder > SMALL_SIZE:
            after = block.next
            rest = _Block(block.address + size, remainder, small, True, block, after)
            if after is not None:
                after.prev = rest
            block.next = rest
            block.size = size
            self._by_address[rest.address] = rest
            bisect.insort(pool, (remainder, rest.address))
        block.free = False
        allocated = self.allocated + block.size
        self.allocated = allocated
        if allocated > self.peak_allocated:
            self.peak_allocated = allocated
        if self.pinned > self.peak_pinned:
            self.peak_pinned = self.pinned
        return block.address

    def free(self, address: int) -> None:
        block = self._by_address[address]
        self.allocated -= block.size
        block.free = True
        before, after = block.prev, block.next
        if before is not None and before.free:
            self._remove(before)
            block = self._merge(block, before)
        if after is not None and after.free:
            self._remove(after)
            block = self._merge(block, after)
        if block.prev is None and block.next is None:  # its segment holds no allocated block any more
            self.pinned -= block.size
        bisect.insort(self._small if block.small else self._large, (block.size, block.address))

    def _new_segment(self, size: int, small: bool) -> _Block:
        block = _Block(self._next_address, size, small)
        self._next_address += size + (1 << 30)  # segments are never adjacent
        self._by_address[block.address] = block
        self.reserved += size
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved
        return block

    def _merge(self, block: _Block, neighbour: _Block) -> _Block:
        first, second = (block, neighbour) if block.address < neighbour.address else (neighbour, block)
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        del self._by_address[second.address]
        return first

    def _remove(self, block: _Block) -> None:
        pool = self._small if block.small else self._large
        index = bisect.bisect_left(pool, (block.size, block.address))
        assert pool[index] == (block.size, block.address)
        pool.pop(index)

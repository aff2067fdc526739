"""The caching-allocator simulation against the rules of c10/cuda/CUDACachingAllocator.cpp."""

from tunecast.estimate.allocator import (
    LARGE_BUFFER,
    ROUND_LARGE,
    SMALL_BUFFER,
    CachingAllocator,
    round_size,
    segment_size,
)

MIB = 1 << 20


def test_rounding_and_segment_sizes() -> None:
    assert (round_size(1), round_size(512), round_size(513)) == (512, 512, 1024)
    assert segment_size(1 * MIB) == SMALL_BUFFER
    assert segment_size(1 * MIB + 512) == LARGE_BUFFER
    assert segment_size(10 * MIB) == 10 * MIB
    assert segment_size(11 * MIB + 1) == 12 * MIB == 6 * ROUND_LARGE


def test_small_requests_share_a_2mib_segment() -> None:
    allocator = CachingAllocator()
    for _ in range(4):
        allocator.malloc(100_000)
    assert allocator.reserved == SMALL_BUFFER
    assert allocator.allocated == 4 * round_size(100_000)


def test_freed_blocks_are_reused_and_merged() -> None:
    allocator = CachingAllocator()
    first = allocator.malloc(40 * MIB)
    allocator.free(first)
    allocator.malloc(15 * MIB)  # split from the free 40 MiB segment: no new segment
    allocator.malloc(25 * MIB)  # the 25 MiB remainder fits exactly
    assert allocator.reserved == 40 * MIB


def test_a_larger_request_needs_a_new_segment() -> None:
    allocator = CachingAllocator()
    block = allocator.malloc(30 * MIB)
    allocator.free(block)
    allocator.malloc(31 * MIB)
    assert allocator.reserved == 30 * MIB + 32 * MIB
    # A remainder of 1 MiB is not split off a large block, and allocated counts the whole block.
    assert allocator.peak_allocated == 32 * MIB


def test_neighbours_merge_back_into_one_block() -> None:
    allocator = CachingAllocator()
    a = allocator.malloc(12 * MIB)
    allocator.free(a)
    parts = [allocator.malloc(4 * MIB), allocator.malloc(4 * MIB)]  # 4 + 4 split off, 4 left
    for part in parts:
        allocator.free(part)
    allocator.malloc(12 * MIB)  # fits only if the three 4 MiB pieces merged again
    assert allocator.reserved == 12 * MIB

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


def test_what_the_process_holds_at_least_is_the_segments_with_a_live_block() -> None:
    """At the edge the allocator gives back every cached segment that holds no allocated block before it fails; the
    segments a live block holds stay. The growing requests below leave three free segments cached (30, 32 and 34 MiB
    beside the 36 MiB one the live block takes), but at most one segment ever holds a live block at a time."""
    allocator = CachingAllocator()
    for size in (30 * MIB, 31 * MIB, 33 * MIB, 35 * MIB):
        allocator.free(allocator.malloc(size))
    live = allocator.malloc(36 * MIB)
    assert allocator.reserved == allocator.peak_reserved == (30 + 32 + 34 + 36) * MIB
    assert (allocator.pinned, allocator.peak_pinned) == (36 * MIB, 36 * MIB)
    small = allocator.malloc(100_000)  # a 2 MiB small segment, held while its block lives
    assert allocator.pinned == 36 * MIB + SMALL_BUFFER
    allocator.free(small)
    allocator.free(live)
    assert allocator.pinned == 0 and allocator.peak_pinned == 36 * MIB + SMALL_BUFFER


def test_a_segment_with_one_block_still_live_stays_held() -> None:
    allocator = CachingAllocator()
    first = allocator.malloc(12 * MIB)
    allocator.free(first)
    a, b = allocator.malloc(4 * MIB), allocator.malloc(4 * MIB)  # both split from the one 12 MiB segment
    assert allocator.pinned == 12 * MIB
    allocator.free(a)
    assert allocator.pinned == 12 * MIB  # b still lives in it
    allocator.free(b)
    assert allocator.pinned == 0

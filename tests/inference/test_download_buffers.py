"""The S3 fetcher's reusable download buffers: sizes, reuse, the idle cap."""

from __future__ import annotations

import pytest

from inference_svc.adapters.download_buffers import GRANULE, DownloadBuffers, buffer_size


def test_sizes_round_up_to_a_power_of_two_then_to_granules() -> None:
    assert buffer_size(1) == 1
    assert buffer_size(5000) == 8192
    assert buffer_size(GRANULE) == GRANULE
    assert buffer_size(GRANULE + 1) == 2 * GRANULE
    assert buffer_size(5 * GRANULE - 3) == 5 * GRANULE


def test_a_released_buffer_serves_the_next_fetch_that_fits() -> None:
    pool = DownloadBuffers(keep_bytes=1 << 20)
    first = pool.acquire(3000)
    pool.release(first)
    assert pool.idle_bytes == len(first) == 4096
    assert pool.acquire(4000) is first
    assert pool.idle_bytes == 0
    bigger = pool.acquire(5000)  # nothing idle fits: a new one
    assert bigger is not first and len(bigger) == 8192


def test_concurrent_holders_never_share_a_buffer() -> None:
    pool = DownloadBuffers(keep_bytes=1 << 20)
    held = [pool.acquire(1000) for _ in range(3)]
    assert len({id(buffer) for buffer in held}) == 3
    for buffer in held:
        pool.release(buffer)
    assert pool.idle_bytes == 3 * 1024
    assert pool.acquire(10) in held  # the smallest that fits: any of the equal ones


def test_idle_buffers_stay_within_keep_bytes() -> None:
    pool = DownloadBuffers(keep_bytes=10_000)
    small, large = pool.acquire(2000), pool.acquire(8000)
    pool.release(small)
    pool.release(large)  # 2048 + 8192 > 10000: the smaller one goes
    assert pool.idle_bytes == 8192
    assert pool.acquire(100) is large
    huge = pool.acquire(20_000)
    pool.release(huge)  # larger than keep_bytes by itself: let go
    assert pool.idle_bytes == 0


def test_a_lease_is_exactly_the_size_asked_and_goes_back_on_error() -> None:
    pool = DownloadBuffers(keep_bytes=1 << 20)
    with pytest.raises(RuntimeError), pool.lease(3000) as view:
        assert len(view) == 3000 and not view.readonly
        raise RuntimeError("the fetch failed")
    assert pool.idle_bytes == 4096


def test_misuse_is_refused() -> None:
    pool = DownloadBuffers(keep_bytes=1 << 20)
    buffer = pool.acquire(10)
    pool.release(buffer)
    with pytest.raises(ValueError, match="released twice"):
        pool.release(buffer)
    with pytest.raises(ValueError, match=">= 1 byte"):
        pool.acquire(0)
    with pytest.raises(ValueError, match="keep_bytes"):
        DownloadBuffers(keep_bytes=-1)

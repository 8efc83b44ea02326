"""``hybridkv.connector.datapath.staging.HostBufferPool``: the host path's pre-faulted private buffers.

A buffer given back by a batch whose store calls returned on time is reused; one a late call holds leaves the
pool for good; the pooled bytes stay within the budget, and a request beyond it gets a one-off buffer.
"""

from __future__ import annotations

import resource

import numpy as np
import pytest
from hybridkv.connector.datapath.staging import HostBufferPool, host_buffer_capacity

MIB = 1 << 20


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def test_capacity_rounds_up_by_at_most_an_eighth_in_whole_pages() -> None:
    for n in (1, 4095, 4096, 4097, 100_000, 3 * MIB + 1, 65_011_712, 64 * MIB, 64 * MIB + 1):
        c = host_buffer_capacity(n)
        assert c >= n and c % 4096 == 0
        assert c <= max(4096, n + n // 8 + 4095), (n, c)
    assert host_buffer_capacity(62 * MIB) == host_buffer_capacity(61 * MIB + 5) == 64 * MIB


def test_a_buffer_is_faulted_in_once_and_reused() -> None:
    pool = HostBufferPool(64 * MIB)
    buffer = pool.acquire(16 * MIB)
    assert buffer.capacity >= 16 * MIB and buffer.pooled
    before = _minor_faults()
    buffer.array[: 16 * MIB] = 7  # what a store call writes: every page is there already
    assert _minor_faults() - before < 64, "the pool handed out a buffer whose pages were not touched"
    buffer.release()
    again = pool.acquire(15 * MIB)
    assert again is buffer and again.array[0] == 7
    assert (pool.num_allocated, pool.num_reused, pool.num_one_off) == (1, 1, 0)
    again.release()
    again.release()  # idempotent: listed once
    assert pool.num_idle == 1


def test_the_smallest_idle_buffer_that_fits_is_handed_out() -> None:
    pool = HostBufferPool(64 * MIB)
    big, small = pool.acquire(8 * MIB), pool.acquire(1 * MIB)
    big.release()
    small.release()
    assert pool.acquire(512 << 10) is small
    assert pool.acquire(2 * MIB) is big
    grown = pool.acquire(2 * MIB)  # none idle: a new one
    assert grown is not big and grown is not small and pool.num_allocated == 3


def test_pooled_bytes_stay_within_the_budget() -> None:
    pool = HostBufferPool(16 * MIB)
    held = [pool.acquire(4 * MIB) for _ in range(4)]
    assert all(b.pooled for b in held) and pool.pooled_bytes == 16 * MIB
    extra = pool.acquire(4 * MIB)  # every pooled byte is out: a one-off, never waited for
    assert not extra.pooled and extra.capacity >= 4 * MIB and pool.num_one_off == 1
    extra.release()
    assert pool.num_idle == 0, "a one-off buffer was kept"
    for b in held:
        b.release()
    bigger = pool.acquire(12 * MIB)  # makes room: idle buffers dropped, smallest first
    assert bigger.pooled and pool.pooled_bytes <= 16 * MIB
    assert pool.num_evicted == 3 and pool.num_idle == 1


def test_a_forfeited_buffer_is_never_handed_out_again() -> None:
    """A buffer a late store call holds leaves the pool when it is forfeited: it is not counted any more,
    it is dropped when released (once the call returned), and the pool allocates a replacement."""
    pool = HostBufferPool(8 * MIB)
    late = pool.acquire(4 * MIB)
    late.forfeit()
    late.forfeit()  # idempotent
    assert pool.pooled_bytes == 0 and pool.num_forfeited == 1
    replacement = pool.acquire(4 * MIB)
    assert replacement is not late and replacement.pooled
    late.release()  # the late call returned
    replacement.release()
    handed_out = [pool.acquire(4 * MIB), pool.acquire(4 * MIB), pool.acquire(4 * MIB)]
    assert all(b is not late for b in handed_out)
    assert not any(np.shares_memory(b.array, late.array) for b in handed_out)


def test_a_released_buffer_cannot_be_forfeited() -> None:
    """Forfeiting is for a buffer still out to a call: one already given back may be another batch's."""
    pool = HostBufferPool(8 * MIB)
    buffer = pool.acquire(MIB)
    buffer.release()
    with pytest.raises(AssertionError, match="forfeited after its release"):
        buffer.forfeit()


def test_drop_idle_frees_only_idle_buffers() -> None:
    """Sleep mode and shutdown give idle memory back; a buffer out stays its holder's."""
    pool = HostBufferPool(1 << 20)
    kept, dropped = pool.acquire(4096), pool.acquire(8192)
    dropped.release()
    assert pool.num_idle == 1
    assert pool.drop_idle() >= 8192
    assert pool.num_idle == 0 and pool.pooled_bytes == kept.capacity
    kept.release()
    assert pool.num_idle == 1  # still pooled: reused by the next acquire
    assert pool.acquire(4096) is kept

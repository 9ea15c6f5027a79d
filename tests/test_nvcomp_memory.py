"""nvCOMP's scratch memory given back in stream order (gdsload.codecs.nvcomp_memory), on the CPU: the events
and the pool are stand-ins, the rules are the module's."""

from __future__ import annotations

import gc

from gdsload.codecs.nvcomp_memory import StreamOrdered


class Event:
    def __init__(self):
        self.done = False


class Stream:
    def __init__(self, ptr: int, device: int = 0):
        self.ptr, self.device = ptr, device


class Pool:
    """Blocks handed out by address; a block is free again once nothing refers to it."""

    def __init__(self):
        self.calls: list[tuple[int, int]] = []

    def __call__(self, nbytes: int, device: int):
        self.calls.append((nbytes, device))
        return Block(0x1000 * len(self.calls))


class Block:
    def __init__(self, ptr: int):
        self.ptr = ptr


def test_a_block_nvcomp_lets_go_is_held_until_its_stream_has_passed_that_point():
    events: list[tuple[int, int, Event]] = []

    def record(stream_ptr, device):
        events.append((stream_ptr, device, Event()))
        return events[-1][2]

    pool = Pool()
    alloc = StreamOrdered(pool, record, lambda: (7, 1))
    lease = alloc(100, Stream(0))
    assert lease.ptr == 0x1000 and pool.calls == [(100, 1)]
    block = lease.memory
    del lease
    gc.collect()
    assert [(p, d) for p, d, _ in events] == [(7, 1)]  # on the stream current at the allocation, its device
    assert alloc.held == 1
    alloc.reap()
    assert alloc.held == 1  # queued work on stream 7 may still use the block
    events[0][2].done = True
    kept = alloc(0, Stream(0))  # the next allocation gives back what has passed (a zero-byte ask gets one byte)
    assert alloc.held == 0 and pool.calls[-1] == (1, 1) and kept.ptr == 0x2000
    assert block.ptr == 0x1000


def test_blocks_go_back_in_release_order_and_a_later_one_waits_its_turn():
    made: list[Event] = []

    def record(stream_ptr, device):
        made.append(Event())
        return made[-1]

    alloc = StreamOrdered(Pool(), record, lambda: (1, 0))
    leases = [alloc(10, Stream(1)) for _ in range(3)]
    del leases[:]
    gc.collect()
    assert alloc.held == 3
    made[1].done = made[2].done = True
    alloc.reap()
    assert alloc.held == 3  # the first is still in use: nothing behind it is given back before it
    made[0].done = True
    alloc.reap()
    assert alloc.held == 0

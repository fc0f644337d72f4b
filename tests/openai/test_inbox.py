"""The frontend's inbox: outputs posted from an engine thread reach their queues in order, a burst wakes the
event loop once, and a closed loop is reported to the poster."""

from __future__ import annotations

import asyncio
import threading

import pytest

from server.openai.generation import _Inbox


def test_a_burst_from_another_thread_arrives_in_order_with_one_wakeup():
    async def main() -> tuple[list[int], list[int], int]:
        loop = asyncio.get_running_loop()
        inbox = _Inbox(loop)
        drains = 0
        original = inbox._drain

        def counting_drain() -> None:
            nonlocal drains
            drains += 1
            original()

        inbox._drain = counting_drain
        first, second = asyncio.Queue(), asyncio.Queue()
        posted = threading.Event()

        def engine_step() -> None:  # one step's outputs, back to back, as the engine thread emits them
            for i in range(32):
                inbox.post(first if i % 2 == 0 else second, i)
            posted.set()

        # the loop is busy (not yielding) while the thread posts, as it is while the engine holds the GIL
        thread = threading.Thread(target=engine_step)
        thread.start()
        posted.wait(10)
        thread.join()
        got = [[await first.get() for _ in range(16)], [await second.get() for _ in range(16)]]
        return got[0], got[1], drains

    evens, odds, drains = asyncio.run(main())
    assert evens == list(range(0, 32, 2)) and odds == list(range(1, 32, 2))
    assert drains == 1


def test_posts_after_a_drain_schedule_the_next_one():
    async def main() -> list[int]:
        inbox = _Inbox(asyncio.get_running_loop())
        queue: asyncio.Queue = asyncio.Queue()
        out = []
        for burst in range(3):
            await asyncio.to_thread(lambda b=burst: [inbox.post(queue, b * 10 + i) for i in range(3)])
            out += [await queue.get() for _ in range(3)]
        return out

    assert asyncio.run(main()) == [0, 1, 2, 10, 11, 12, 20, 21, 22]


def test_a_closed_loop_raises_and_the_next_post_tries_again():
    loop = asyncio.new_event_loop()
    inbox = _Inbox(loop)
    loop.close()
    with pytest.raises(RuntimeError):
        inbox.post(asyncio.Queue(), 1)
    with pytest.raises(RuntimeError):  # not silently swallowed as "a drain is already scheduled"
        inbox.post(asyncio.Queue(), 2)

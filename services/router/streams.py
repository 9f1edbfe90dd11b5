"""Several prompts' chunk streams run concurrently and read as one."""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator


async def merge(streams: list, max_concurrent: int | None = None) -> AsyncIterator[tuple[int, object]]:
    """Yields (index, item) as items arrive; the first error cancels the other streams. At most
    `max_concurrent` streams run at once (None: all); the others start, in order, as those end."""
    if len(streams) == 1:  # the common case pays for no task and no queue
        async with contextlib.aclosing(streams[0]):
            async for item in streams[0]:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()
    seats = asyncio.Semaphore(max_concurrent or len(streams))

    async def pump(i: int, stream) -> None:
        try:
            async with seats, contextlib.aclosing(stream):
                async for item in stream:
                    queue.put_nowait((i, item, None))
        except Exception as e:  # handed to the reader, which raises it
            queue.put_nowait((i, done, e))
        else:
            queue.put_nowait((i, done, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            i, item, error = await queue.get()
            if error is not None:
                raise error
            if item is done:
                running -= 1
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

"""A step run every `interval` until told to stop: the watchdogs' loop, written once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable


async def every(interval: float, step: Callable[[], Awaitable[object]],
                stop: asyncio.Event | None = None,
                on_error: Callable[[Exception], None] | None = None) -> None:
    """Run `step` every `interval` s until `stop` is set; the next starts after this one
    ends. An exception in a step goes to `on_error` and the loop goes on: a watchdog must
    outlive one bad read."""
    stop = stop or asyncio.Event()
    while not stop.is_set():
        try:
            await step()
        except Exception as exc:
            if on_error is not None:
                on_error(exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)

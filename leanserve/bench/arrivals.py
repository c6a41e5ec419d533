"""When requests are sent: a Poisson process at a given rate (gamma-distributed gaps with ``burstiness``, as vLLM's
``bench serve``), everything at once (rate ``inf``), and an optional cap on requests in flight."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import numpy as np

T = TypeVar("T")
R = TypeVar("R")


def arrival_offsets(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times of ``num`` requests in seconds from the start, nondecreasing.

    The gaps are gamma-distributed with shape ``burstiness`` and mean ``1 / rate`` seconds: ``burstiness`` 1 is a
    Poisson process, below 1 burstier, above 1 more regular. ``rate`` is in requests per second; ``inf`` sends
    every request at time 0. The first request is sent after one gap, as vLLM does.

    Raises:
        ValueError: ``rate`` or ``burstiness`` is not positive, or ``num`` is negative.
    """
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 requests/s, got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * num
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num)
    return np.cumsum(gaps).tolist()


async def dispatch(items: Sequence[T], send: Callable[[T], Awaitable[R]], offsets: Sequence[float],
                   max_concurrency: int | None = None,
                   on_done: Callable[[R], None] | None = None) -> list[R]:
    """Call ``send(item)`` for each item at its offset (seconds after the call), with at most ``max_concurrency``
    calls in flight (None: no cap; a request due while the cap is reached waits for a free slot). ``on_done``
    is called with each result as it completes. Returns the results in the order of ``items``.

    Raises:
        ValueError: ``offsets`` and ``items`` differ in length, or ``max_concurrency`` < 1.
    """
    if len(offsets) != len(items):
        raise ValueError(f"{len(items)} items but {len(offsets)} send times")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    start = time.perf_counter()

    async def one(item: T, offset: float) -> R:
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if slots is None:
            result = await send(item)
        else:
            async with slots:
                result = await send(item)
        if on_done is not None:
            on_done(result)
        return result

    return list(await asyncio.gather(*(one(item, off) for item, off in zip(items, offsets, strict=True))))

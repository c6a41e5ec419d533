"""Arrival process: gamma/Poisson send times and the cap on requests in flight."""

from __future__ import annotations

import asyncio
import math
import time

from leanserve.bench.arrivals import arrival_offsets, dispatch

import numpy as np
import pytest


def test_infinite_rate_sends_everything_at_once():
    assert arrival_offsets(5, math.inf) == [0.0] * 5


@pytest.mark.parametrize("burstiness, cv", [(1.0, 1.0), (0.25, 2.0), (4.0, 0.5)])
def test_mean_rate_and_burstiness(burstiness, cv):
    offsets = np.array(arrival_offsets(20_000, rate=4.0, burstiness=burstiness, seed=3))
    gaps = np.diff(np.concatenate([[0.0], offsets]))
    assert np.all(gaps >= 0)
    assert 1.0 / gaps.mean() == pytest.approx(4.0, rel=0.05)  # requests per second
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)  # gamma(k): CV = 1 / sqrt(k)


def test_seeded():
    assert arrival_offsets(10, 2.0, seed=1) == arrival_offsets(10, 2.0, seed=1)
    assert arrival_offsets(10, 2.0, seed=1) != arrival_offsets(10, 2.0, seed=2)


def test_bad_values():
    for kwargs in ({"rate": 0.0}, {"rate": -1.0}, {"rate": 1.0, "burstiness": 0.0}):
        with pytest.raises(ValueError):
            arrival_offsets(3, **kwargs)


def _run_dispatch(n: int, offsets: list[float], cap: int | None) -> tuple[list[int], int, list[float]]:
    state = {"now": 0, "peak": 0}
    sent: list[float] = []

    async def send(i: int) -> int:
        sent.append(time.perf_counter())
        state["now"] += 1
        state["peak"] = max(state["peak"], state["now"])
        await asyncio.sleep(0.02)
        state["now"] -= 1
        return i * 10

    async def main():
        t0 = time.perf_counter()
        out = await dispatch(list(range(n)), send, offsets, cap)
        return out, [t - t0 for t in sent]

    out, times = asyncio.run(main())
    return out, state["peak"], times


def test_max_concurrency_respected():
    out, peak, _ = _run_dispatch(12, [0.0] * 12, cap=3)
    assert out == [i * 10 for i in range(12)]  # results in the order of the items
    assert peak == 3
    _, peak, _ = _run_dispatch(12, [0.0] * 12, cap=None)
    assert peak == 12


def test_requests_wait_for_their_send_time():
    _, _, times = _run_dispatch(3, [0.0, 0.1, 0.2], cap=None)
    assert sorted(times)[1] >= 0.1 and sorted(times)[2] >= 0.2
    with pytest.raises(ValueError):
        _run_dispatch(2, [0.0], cap=None)

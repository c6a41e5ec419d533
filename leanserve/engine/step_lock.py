"""One engine step at a time across the engines of a process (several models in one server).

Every engine thread of a multi-model server holds the process's :class:`StepLock` for the length of one
``LLMEngine.step()``; so each step has every CPU thread to itself (torch's and BLAS's pools, and the native kernels'
spin pool, are process-wide: ``worker/cpu_threads.py``, ``kernels/spin_pool.h``) instead of two steps fighting over
the cores. The lock is fair (first come, first served), so a busy engine cannot starve another: engines waiting at
once alternate step by step.
"""

from __future__ import annotations

import threading
from collections import deque


class StepLock:
    """A FIFO mutex: a context manager; waiters acquire it in the order they asked. Not reentrant."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: deque[object] = deque()
        self._held = False
        self.acquisitions = 0  # how many times it was taken (tests, stats)

    def __enter__(self) -> StepLock:
        me = object()
        with self._cond:
            self._queue.append(me)
            while self._held or self._queue[0] is not me:
                self._cond.wait()
            self._queue.popleft()
            self._held = True
            self.acquisitions += 1
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()

    @property
    def num_waiting(self) -> int:
        """Threads waiting for the lock now."""
        with self._cond:
            return len(self._queue)

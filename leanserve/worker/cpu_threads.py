"""The number of CPU threads leanserve's kernels use: torch's intra-op pool and NumPy's BLAS pool together."""

from __future__ import annotations

from leanserve.errors import InvalidParameterError

import threadpoolctl
import torch


def set_num_threads(n: int) -> None:
    """Use ``n`` threads in torch (attention, elementwise ops, native kernels) and in NumPy's BLAS (matmuls).

    Process-wide, like llama.cpp's ``-t``. With fewer cores free than threads, every parallel region waits for a
    descheduled thread, so on a shared machine fewer threads is faster.

    Raises:
        InvalidParameterError: ``n`` is not an integer >= 1.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidParameterError("num_threads", f"num_threads must be an integer >= 1, got {n!r}")
    torch.set_num_threads(n)
    threadpoolctl.threadpool_limits(n, user_api="blas")

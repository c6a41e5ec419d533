"""The number of CPU threads leanserve's kernels use: torch's intra-op pool and NumPy's BLAS pool together."""

from __future__ import annotations

import logging

import leanserve
from leanserve.errors import InvalidParameterError

import threadpoolctl
import torch

logger = logging.getLogger(__name__)


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


def warn_if_openmp_spins() -> bool:
    """Log a warning, once per call, when OpenMP's wait policy is not PASSIVE (``leanserve.OPENMP_SPINS``): torch
    imported before leanserve with ``OMP_WAIT_POLICY`` unset (or empty, or invalid), or the variable set to ACTIVE.

    OpenMP reads its wait policy when torch loads it; by default its threads then spin after every parallel torch op
    (the sampler's softmax and top-k on a sampled request) on the cores that the native decode kernels' own threads
    need next, which makes CPU decode of sampled requests about twice as slow (README, "Import order"). Returns whether
    it warned.
    """
    if not leanserve.OPENMP_SPINS:
        return False
    logger.warning("OpenMP's wait policy is not PASSIVE (torch imported before leanserve with OMP_WAIT_POLICY unset, "
                   "or set to another value): its threads spin-wait on the cores the decode kernels use (sampled "
                   "decode is ~2x slower). Import leanserve first, or run with OMP_WAIT_POLICY=PASSIVE in the "
                   "environment.")
    return True

"""--threads sets both thread pools (torch's and NumPy's BLAS)."""

from __future__ import annotations

from leanserve.errors import InvalidParameterError
from leanserve.worker.cpu_threads import set_num_threads

import numpy  # noqa: F401  (loads the BLAS library threadpoolctl inspects)
import pytest
import threadpoolctl
import torch


def blas_threads() -> list[int]:
    return [p["num_threads"] for p in threadpoolctl.threadpool_info() if p["user_api"] == "blas"]


def test_set_num_threads_sets_torch_and_blas_pools():
    torch_before, blas_before = torch.get_num_threads(), blas_threads()
    try:
        set_num_threads(1)
        assert torch.get_num_threads() == 1
        assert blas_threads() and set(blas_threads()) == {1}
    finally:
        torch.set_num_threads(torch_before)
        threadpoolctl.threadpool_limits(max(blas_before), user_api="blas")
    assert torch.get_num_threads() == torch_before and blas_threads() == blas_before


@pytest.mark.parametrize("n", [0, -1, 1.5, True, "2"])
def test_invalid_thread_count_is_a_typed_error(n):
    with pytest.raises(InvalidParameterError) as e:
        set_num_threads(n)
    assert e.value.param == "num_threads"

"""--threads sets both thread pools (torch's and NumPy's BLAS)."""

from __future__ import annotations

import os
import subprocess
import sys

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


@pytest.mark.parametrize(("first", "policy", "warns"), [("torch", None, True), ("leanserve", None, False),
                                                        ("torch", "PASSIVE", False), ("torch", "passive", False),
                                                        ("torch", "", True), ("leanserve", "ACTIVE", True)])
def test_openmp_spin_warning_follows_the_import_order(first: str, policy: str | None, warns: bool) -> None:
    """OpenMP's wait policy not PASSIVE (torch imported before leanserve with it unset or empty, or ACTIVE chosen):
    the engine's check warns; PASSIVE in any case, or leanserve first, and it does not (a fresh interpreter each)."""
    code = (f"import {first}\nimport leanserve, torch\nfrom leanserve.worker.cpu_threads import warn_if_openmp_spins\n"
            "import os\nprint(leanserve.OPENMP_SPINS, warn_if_openmp_spins(), os.environ.get('OMP_WAIT_POLICY'))")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | (
        {"OMP_WAIT_POLICY": policy} if policy is not None else {})
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    spins, warned, seen = run.stdout.rstrip("\n").split(" ")
    assert (spins, warned) == (str(warns), str(warns))
    assert ("OMP_WAIT_POLICY=PASSIVE" in run.stderr) == warns
    assert seen == (policy if policy is not None else ("None" if first == "torch" else "PASSIVE"))

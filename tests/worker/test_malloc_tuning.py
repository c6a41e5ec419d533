"""glibc malloc settings (leanserve/worker/malloc_tuning.py): applied once, skipped when opted out or when the user
set glibc's own variables; with them a repeated prefill maps no fresh memory (minor page faults stay near zero;
without them each 512-token prefill takes ~25,000-35,000)."""

from __future__ import annotations

import ctypes
import os
import resource

import leanserve  # noqa: F401  (first: OpenMP wait policy)
from leanserve import LLM, SamplingParams
from leanserve.loader import load_model
from leanserve.worker import malloc_tuning

import pytest
import torch


def _glibc() -> bool:
    try:
        ctypes.CDLL(None).gnu_get_libc_version  # noqa: B018
        return True
    except (OSError, AttributeError):
        return False


@pytest.mark.parametrize("env", [{malloc_tuning.ENV: "0"}, {"MALLOC_MMAP_THRESHOLD_": "65536"},
                                 {"MALLOC_TRIM_THRESHOLD_": "0"}, {"MALLOC_TOP_PAD_": "0"}])
def test_skipped_when_opted_out_or_set_by_the_user(monkeypatch, env) -> None:
    for name in (malloc_tuning.ENV, *malloc_tuning.GLIBC_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert malloc_tuning._apply() is False


@pytest.mark.skipif(not _glibc(), reason="mallopt settings are glibc's")
def test_applied_once_on_glibc(monkeypatch) -> None:
    for name in (malloc_tuning.ENV, *malloc_tuning.GLIBC_ENV):
        monkeypatch.delenv(name, raising=False)
    assert malloc_tuning._apply() is True  # mallopt accepted every value
    monkeypatch.setattr(malloc_tuning, "_applied", None)
    calls = []
    monkeypatch.setattr(malloc_tuning, "_apply", lambda: calls.append(1) or True)
    assert malloc_tuning.tune_malloc() and malloc_tuning.tune_malloc() and calls == [1]


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.mark.skipif(not _glibc() or os.environ.get(malloc_tuning.ENV) == "0"
                    or any(n in os.environ for n in malloc_tuning.GLIBC_ENV),
                    reason="the engine's malloc settings are off here")
def test_repeated_prefill_maps_no_fresh_memory() -> None:
    """A 512-token prefill (GGUF 4-bit weights, bf16 prefill GEMMs where the CPU has them) repeated: after two
    warm-up runs (which touch the small KV pool and grow the heap) each takes under 2,000 minor page faults.

    The loaded model stays referenced (as a caller's would): freeing its large tensors would raise glibc's dynamic
    mmap threshold by chance and hide the churn that the settings remove whatever the history."""
    loaded = load_model(None, quantization="auto")
    llm = LLM(loaded=loaded, quantization="auto", kv_cache_memory=32 << 20, enable_prefix_caching=False)
    ids = torch.randint(100, 40000, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0, max_tokens=1)
    counts = []
    for _ in range(5):
        before = _faults()
        llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        counts.append(_faults() - before)
    assert max(counts[2:]) < 2000, counts
    assert loaded.config.num_layers == 30

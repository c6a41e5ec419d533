"""Two engines in one process stepping at the same moment (several models in one server with
``--no-serialize-model-steps``) share torch's and BLAS's pools and the native kernels' spin pool
(``kernels/spin_pool.h``): their greedy tokens must be exactly those each computes alone, with no deadlock."""

from __future__ import annotations

import threading

from leanserve.config import EngineConfig
from leanserve.engine.llm_engine import LLMEngine
from leanserve.engine.step_lock import StepLock
from leanserve.sampling_params import SamplingParams

import pytest

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three facts about owls:"]


def run(engine: LLMEngine, tag: str, lock=None) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"{tag}-{i}", p, params)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        if lock is None:
            outputs = engine.step()
        else:
            with lock:
                outputs = engine.step()
        for o in outputs:
            if o.finished:
                out[o.request_id.split("-", 1)[1]] = list(o.outputs[0].token_ids)
    return out


@pytest.fixture(scope="module")
def engines_and_alone():
    cfg = {"kv_cache_memory": 16 << 20, "max_model_len": 256, "max_num_batched_tokens": 64}
    engines = {"q": LLMEngine(EngineConfig(**cfg)), "f": LLMEngine(EngineConfig(quantization="none", **cfg))}
    alone = {name: run(e, name) for name, e in engines.items()}
    assert all(len(v) == 24 for a in alone.values() for v in a.values())
    return engines, alone


@pytest.mark.parametrize("serialized", [False, True])
def test_two_engines_stepping_at_once_match_each_alone(engines_and_alone, serialized):
    engines, alone = engines_and_alone
    together: dict[str, dict[str, list[int]]] = {}
    lock = StepLock() if serialized else None
    threads = [threading.Thread(target=lambda n=n, e=e: together.__setitem__(n, run(e, n + "2", lock)))
               for n, e in engines.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert together == alone
    if serialized:
        assert lock.acquisitions >= 2 * 24  # every step of both took the lock (24 tokens: >= 24 steps each)

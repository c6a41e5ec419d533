"""Logits of leanserve's fp32 forward equal transformers' LlamaForCausalLM on the same GGUF file."""

from __future__ import annotations

from leanserve.core.kv_cache_manager import cdiv
from leanserve.core.request import Request
from leanserve.core.scheduler import ScheduledRequest
from leanserve.model.llama import LlamaModel
from leanserve.sampling_params import SamplingParams
from leanserve.worker.model_runner import ModelRunner, allocate_kv_cache

import pytest
import torch

BLOCK = 16
PARAGRAPH = ("The river wound through the valley, past fields of barley and old stone walls. In the evening the "
             "fishermen pulled their boats onto the gravel and talked about the weather, the price of bread and "
             "the new bridge that the town council had promised for years. ")


@pytest.fixture(scope="module")
def prompts(loaded):
    tok = loaded.tokenizer
    texts = ["Hello, how are you doing today", "What is the capital of France?",
             "def fibonacci(n):\n    if n < 2:\n        return n", PARAGRAPH * 8]
    ids = [tok.encode(t) for t in texts]
    ids[3] = ids[3][:300]
    assert [len(x) >= 5 for x in ids] == [True] * 4 and len(ids[3]) == 300
    return ids


@pytest.fixture(scope="module")
def model(loaded):
    return LlamaModel(loaded.config, loaded.weights, dtype=torch.float32)


@pytest.fixture(scope="module")
def reference(hf_model, prompts):
    with torch.no_grad():
        return [hf_model(torch.tensor([p])).logits[0, -1].float() for p in prompts]


class Stepper:
    """Runs hand-made steps through ModelRunner.build_inputs and the model."""

    def __init__(self, model: LlamaModel, num_blocks: int = 64, native: bool = False) -> None:
        self.model = model
        self.runner = ModelRunner(model, allocate_kv_cache(model, num_blocks, BLOCK), BLOCK, sampler=None,
                                  use_native_kernels=native)
        self.next_block = 0
        self.tables: dict[str, list[int]] = {}

    def step(self, work: list[tuple[Request, int]]) -> torch.Tensor:
        scheduled = []
        for req, n in work:
            table = self.tables.setdefault(req.request_id, [])
            while len(table) < cdiv(req.num_computed_tokens + n, BLOCK):
                table.append(self.next_block)
                self.next_block += 1
            scheduled.append(ScheduledRequest(req, n, list(table)))
        scheduled.sort(key=lambda s: s.num_new_tokens != 1)
        ids, pos, meta, idx = self.runner.build_inputs(scheduled)
        with torch.inference_mode():
            logits = self.model.compute_logits(self.model.forward(ids, pos, self.runner.kv_caches, meta)[idx])
        order = [s.request.request_id for s in scheduled if s.samples]
        for req, n in work:
            req.num_computed_tokens += n
        return {rid: logits[i] for i, rid in enumerate(order)}


def make_req(rid: str, ids: list[int]) -> Request:
    return Request(rid, list(ids), SamplingParams(max_tokens=1), 1)


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    err = (ours - ref).abs().max().item()
    bound = 1e-3 * ref.abs().max().item()
    assert err <= bound, f"max |diff| {err:.3g} > {bound:.3g}"


def test_each_prompt_alone(model, prompts, reference):
    for i, p in enumerate(prompts):
        out = Stepper(model).step([(make_req("r", p), len(p))])
        assert_close(out["r"], reference[i])


def test_one_forward_mixing_all_prompts(model, prompts, reference):
    reqs = [make_req(str(i), p) for i, p in enumerate(prompts)]
    out = Stepper(model).step([(r, r.num_tokens) for r in reqs])
    for i in range(4):
        assert_close(out[str(i)], reference[i])


@pytest.mark.parametrize("native", [True, False], ids=["native-kernel", "torch-path"])
def test_mixed_decode_chunked_and_fresh_prefill(model, prompts, reference, native):
    """Step 1 prefills prompt 0 minus its last token and the first half of prompt 3; step 2 mixes the decode of
    prompt 0, the second chunk of prompt 3 (attending to cached context) and fresh prefills of prompts 1, 2."""
    s = Stepper(model, native=native)
    assert (s.runner.decode_kernel is not None) == native
    r0, r1, r2, r3 = (make_req(str(i), p) for i, p in enumerate(prompts))
    half = 137
    s.step([(r0, r0.num_tokens - 1), (r3, half)])
    out = s.step([(r0, 1), (r3, r3.num_tokens - half), (r1, r1.num_tokens), (r2, r2.num_tokens)])
    for i in range(4):
        assert_close(out[str(i)], reference[i])

"""`leanserve serve --model gemma3-270m` end to end through the OpenAI SDK: a completion, streamed and not, equal
to transformers' greedy tokens; chat is a 400 (no template in the base model's file); the KV pool ends empty."""

from __future__ import annotations

import pytest

from tests.engine.test_greedy_vs_transformers import hf_greedy
from tests.entrypoints.server_helpers import ServerProcess, parse_metrics

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(gemma_path):
    srv = ServerProcess(["--model", "gemma3-270m", "--kv-cache-memory", str(256 << 20), "--max-model-len", "2048"])
    yield srv.start()
    assert srv.stop() == 0, srv.stderr()[-3000:]


def test_completion_streamed_and_not(server, gemma_loaded, gemma_hf):
    import openai

    client = server.openai()
    assert server.model == "gemma-3-270m-q4_k_m"
    full = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 12
    assert full.usage.prompt_tokens == len(gemma_loaded.tokenizer.encode(PROMPT))
    stream = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == full.choices[0].text
    ref_ids, _ = hf_greedy(gemma_hf, gemma_loaded.tokenizer.encode(PROMPT), 12)  # transformers' greedy tokens
    assert full.choices[0].text == gemma_loaded.tokenizer.decode(ref_ids)
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}])
    with server.client() as c:
        metrics = parse_metrics(c.get("/metrics").text)
    assert metrics[f'vllm:kv_cache_usage_perc{{model_name="{server.model}"}}'] == 0.0

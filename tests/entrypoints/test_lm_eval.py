"""lm-evaluation-harness, unmodified, against a live server: its ``local-completions`` backend (loglikelihood requests:
token ids, ``echo``, ``logprobs: 1``, ``max_tokens: 1``) scores the same as its ``hf`` backend on transformers loading
the same GGUF file, on a small local ARC-style multiple-choice task and a ``loglikelihood_rolling`` perplexity task
(tests/data/lm_eval). Nothing is downloaded: the tokenizer lm-eval uses is the GGUF file's, saved to a folder.

The server runs fp32 weights (``-q none``), transformers' arithmetic; README "Prompt logprobs and lm-eval" has the
numbers of the default configuration too.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before lm_eval / datasets / huggingface_hub read it
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from server_helpers import ServerProcess  # noqa: E402

from tests.conftest import DEFAULT_GGUF, default_model_dir  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data" / "lm_eval"
TASKS = ["leanserve_arc_mini", "leanserve_ppl_mini"]
MAX_LEN = 1024


@pytest.fixture(scope="module")
def fp32_server():
    srv = ServerProcess(["--kv-cache-memory", str(256 << 20), "--max-model-len", str(MAX_LEN), "-q", "none"],
                        api_key=None).start()
    yield srv
    assert srv.stop() == 0, srv.stderr()[-3000:]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """The GGUF file's tokenizer (transformers' conversion) saved as a Hugging Face folder, for lm-eval."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    AutoTokenizer.from_pretrained(default_model_dir(), gguf_file=DEFAULT_GGUF).save_pretrained(path)
    return str(path)


def evaluate(backend, **model_args) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    cwd = os.getcwd()
    os.chdir(DATA)  # the task YAMLs name their JSONL files relative to the working directory
    try:
        out = lm_eval.simple_evaluate(model=backend, model_args=model_args or None, tasks=TASKS,
                                      task_manager=TaskManager(include_path=str(DATA), include_defaults=False))
    finally:
        os.chdir(cwd)
    return out["results"]


def test_echo_logprobs_over_http_equal_transformers(fp32_server, hf_model, loaded):
    ids = loaded.tokenizer.encode("Question: What do bees collect from flowers to make honey?\nAnswer: nectar")
    with fp32_server.client() as c:
        out = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1}).json()
    got = out["choices"][0]["logprobs"]["token_logprobs"]
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert got[0] is None
    worst = max(abs(got[i] - ref[i - 1, ids[i]].item()) for i in range(1, len(ids)))
    assert worst <= 1e-3, worst


@pytest.mark.slow
def test_local_completions_equals_the_hf_backend(fp32_server, hf_model, tokenizer_dir):
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    api = evaluate("local-completions", model=fp32_server.model, base_url=f"{fp32_server.url}/v1/completions",
                   tokenizer_backend="huggingface", tokenizer=tokenizer_dir, tokenized_requests=True,
                   max_length=MAX_LEN, batch_size=16, num_concurrent=1)
    # lm-eval's hf backend on the transformers model of the same GGUF file (the session's, loaded once); API models
    # keep one position for the generated token, so the same windows need max_length - 1 here
    hf = evaluate(HFLM(pretrained=hf_model, tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir),
                       max_length=MAX_LEN - 1, batch_size=16, device="cpu"))
    arc_api, arc_hf = api["leanserve_arc_mini"], hf["leanserve_arc_mini"]
    ppl_api, ppl_hf = api["leanserve_ppl_mini"], hf["leanserve_ppl_mini"]
    print(f"acc {arc_api['acc,none']} vs {arc_hf['acc,none']}; word_perplexity {ppl_api['word_perplexity,none']} "
          f"vs {ppl_hf['word_perplexity,none']}")
    assert 0.3 < arc_hf["acc,none"] < 1.0  # the task discriminates (well above chance, not saturated)
    for metric in ("acc,none", "acc_norm,none"):
        assert abs(arc_api[metric] - arc_hf[metric]) <= 0.01, metric
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert abs(ppl_api[metric] / ppl_hf[metric] - 1) <= 1e-3, metric

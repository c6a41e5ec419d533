"""The learned router with the real WordLlama embedder on the routing benchmark's labelled set
(benchmarks/data/routing_set.jsonl): clear cases go where they should, and a threshold calibrated on the set's
calibration split sends the target share of its held-out split to the strong model, within 5 points."""

from __future__ import annotations

import json
from pathlib import Path

from leanserve.embeddings import WordLlamaEmbedder
from leanserve.routing import LearnedPolicy, RouteInput

import numpy as np
import pytest

SET = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "routing_set.jsonl"


@pytest.fixture(scope="module")
def split():
    items = [json.loads(line) for line in SET.read_text().splitlines()]
    return {name: [it for it in items if it["split"] == name] for name in ("examples", "calibration", "heldout")}


@pytest.fixture(scope="module")
def policy(split):
    ex = split["examples"]
    return LearnedPolicy("cheap", "strong", WordLlamaEmbedder(), [it["question"] for it in ex if it["label"] == "easy"],
                         [it["question"] for it in ex if it["label"] == "hard"])


@pytest.mark.parametrize(("text", "model"), [
    ("What does this Python code print?\n```python\nxs = [4, 9, 1]\nprint(max(xs) - 2)\n```", "strong"),
    ("Compute (23 * 7) - 15 + 48.", "strong"),
    ("Repeat exactly: candle meadow", "cheap"),
    ("Sentence: The fox is red.\nIs the fox blue? Answer yes or no.", "cheap"),
    ("What is the first letter of the word tunnel?", "cheap"),
])
def test_clear_cases(policy, text, model):
    policy.threshold = 0.5
    assert policy.decide(RouteInput(text)).model == model


@pytest.mark.parametrize("share", [0.1, 0.2, 0.3, 0.5])
def test_calibrated_share_holds_on_heldout(policy, split, share):
    threshold = policy.calibrate([it["question"] for it in split["calibration"]], share)
    scores = policy.score([it["question"] for it in split["heldout"]])
    got = float(np.mean(scores >= threshold))
    print(f"target {share:.2f}: threshold {threshold:.3f}, held-out share {got:.3f} of {len(scores)}")
    assert abs(got - share) <= 0.05


def test_flag_with_the_default_embedder(split, tmp_path):
    """``--model-router learned:FILE --strong-share 0.3``: WordLlama by default, calibrated on the examples (each
    scored without itself)."""
    from leanserve.routing import build_router, parse_router_flag

    path = tmp_path / "examples.jsonl"
    path.write_text("".join(json.dumps({"text": it["question"], "label": it["label"]}) + "\n"
                            for it in split["examples"]))
    policy = build_router(parse_router_flag(f"learned:{path}", "cheap", "strong", strong_share=0.3))
    assert isinstance(policy.embedder, WordLlamaEmbedder)
    assert float(np.mean(policy.example_scores() >= policy.threshold)) == pytest.approx(0.3, abs=0.01)
    assert policy.decide(RouteInput("Compute (23 * 7) - 15 + 48.")).model == "strong"

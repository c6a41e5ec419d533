"""The learned router, in the spirit of RouteLLM (Ong et al. 2024, arXiv:2406.18665: a router trained on labelled
requests, its threshold calibrated to a target share of strong-model calls): here a similarity-weighted
nearest-neighbours scorer over requests the user labelled easy or hard, on sentence embeddings.

Score of a text (in [0, 1]): embed it (L2-normalized), and return the share of hard examples among the labelled
ones, each weighted by a softmax of its cosine similarity s_i at ``temperature`` T (Nadaraya-Watson kernel
regression: sum(w_i x hard_i) / sum(w_i), w_i = exp(s_i / T)). A small T makes it the label of the nearest
examples; unlike a plain k-nearest-neighbours vote it gives no ties (many requests with all k neighbours hard
score exactly 1), so a quantile threshold can split them. The request goes to the strong model when
score >= threshold.

:meth:`LearnedPolicy.calibrate` sets the threshold from unlabelled calibration texts so that a target share of
them scores at or above it (a quantile); the share on new requests then matches as far as they resemble the
calibration ones.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from leanserve.errors import RouterConfigError
from leanserve.routing.base import RouteDecision, RouteInput

import numpy as np

LABELS = ("easy", "hard")


class Embedder(Protocol):
    """Texts -> (n, d) float32 rows of L2 norm 1 (:class:`leanserve.embeddings.WordLlamaEmbedder`)."""

    def embed(self, texts: list[str]) -> np.ndarray: ...


def load_examples(path: str | Path) -> tuple[list[str], list[str]]:
    """(easy texts, hard texts) of a JSONL file of ``{"text": str, "label": "easy"|"hard"}`` lines (blank lines
    skipped; other keys ignored).

    Raises:
        RouterConfigError: the file cannot be read, a line is not such an object (``param``: ``"FILE:LINE"``, with
            ``.text`` or ``.label`` for a bad field), or a label has no example.
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise RouterConfigError("examples", f"cannot read the router's examples file {path}: {exc}") from None
    easy: list[str] = []
    hard: list[str] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path.name}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RouterConfigError(where, f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise RouterConfigError(where, f"{where}: each line must be an object with text and label")
        text, label = row.get("text"), row.get("label")
        if not isinstance(text, str) or not text.strip():
            raise RouterConfigError(f"{where}.text", f"{where}: text must be a non-empty string, got {text!r}")
        if label not in LABELS:
            raise RouterConfigError(f"{where}.label", f"{where}: label must be 'easy' or 'hard', got {label!r}")
        (easy if label == "easy" else hard).append(text)
    for label, texts in (("easy", easy), ("hard", hard)):
        if not texts:
            raise RouterConfigError("examples", f"{path}: no example labelled {label!r} (both labels are needed)")
    return easy, hard


class LearnedPolicy:
    """Similarity-weighted hardness score over labelled examples; ``strong`` when it reaches ``threshold``.

    Args:
        embedder: see :class:`Embedder`; called once here for the examples and once per :meth:`score` call.
        easy_examples, hard_examples: labelled request texts (each non-empty).
        threshold: in [0, 1]; :meth:`calibrate` replaces it.
        temperature: of the similarity softmax (> 0; cosine units).

    Raises:
        RouterConfigError: an empty label, a threshold outside [0, 1], a temperature that is not > 0.
    """

    kind = "learned"

    def __init__(self, cheap: str, strong: str, embedder: Embedder, easy_examples: Sequence[str],
                 hard_examples: Sequence[str], threshold: float = 0.5, temperature: float = 0.1) -> None:
        if not easy_examples or not hard_examples:
            raise RouterConfigError("examples", "the learned router needs examples of both labels, easy and hard")
        _check_unit("threshold", threshold)
        if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not temperature > 0 \
                or not math.isfinite(temperature):
            raise RouterConfigError("temperature", f"temperature must be a number > 0, got {temperature!r}")
        self.cheap, self.strong, self.embedder = cheap, strong, embedder
        self.threshold = float(threshold)
        texts = list(easy_examples) + list(hard_examples)
        self._vectors = np.asarray(embedder.embed(texts), dtype=np.float32)
        self._hard = np.array([0.0] * len(easy_examples) + [1.0] * len(hard_examples), dtype=np.float32)
        self.temperature = float(temperature)

    def score(self, texts: Sequence[str]) -> np.ndarray:
        """(len(texts),) float64 hardness scores in [0, 1] (see the module's docstring)."""
        if not texts:
            return np.zeros(0)
        return self._score_sims(np.asarray(self.embedder.embed(list(texts)), dtype=np.float32) @ self._vectors.T)

    def _score_sims(self, sims: np.ndarray) -> np.ndarray:
        z = sims.astype(np.float64) / self.temperature
        w = np.exp(z - z.max(axis=1, keepdims=True))  # -inf similarities (an excluded example) weigh 0
        return (w @ self._hard.astype(np.float64)) / w.sum(axis=1)

    def example_scores(self) -> np.ndarray:
        """Leave-one-out scores of the labelled examples themselves (each scored without itself): calibration
        texts when the user gives no others."""
        sims = self._vectors @ self._vectors.T
        np.fill_diagonal(sims, -np.inf)
        return self._score_sims(sims)

    def decide(self, request: RouteInput) -> RouteDecision:
        s = float(self.score([request.text])[0])
        if s >= self.threshold:
            return RouteDecision(self.strong, self.kind, f"learned: score {s:.2f} >= threshold {self.threshold:.2f}",
                                 s)
        return RouteDecision(self.cheap, self.kind, f"learned: score {s:.2f} < threshold {self.threshold:.2f}", s)

    def calibrate(self, texts: Sequence[str] | None, strong_share: float) -> float:
        """Set and return the threshold that sends ``strong_share`` of ``texts`` (None: the examples, left one
        out) to the strong model: see :func:`threshold_for_share`.

        Raises:
            RouterConfigError: a share outside [0, 1] or no texts.
        """
        scores = self.example_scores() if texts is None else self.score(texts)
        self.threshold = threshold_for_share(scores, strong_share)
        return self.threshold


def threshold_for_share(scores: Sequence[float], strong_share: float) -> float:
    """The threshold t such that round(share x n) of ``scores`` are >= t: midway between the k-th and (k+1)-th
    highest scores (k = round(share x n)), so a new score near the calibration ones falls on the same side; above
    every score (at most 1, or just over the top one) for a share of 0, the lowest score for a share of 1. Ties at
    the cut go to the strong side.

    Raises:
        RouterConfigError: a share outside [0, 1] or no scores.
    """
    _check_unit("strong_share", strong_share)
    ordered = sorted((float(s) for s in scores), reverse=True)
    if not ordered:
        raise RouterConfigError("strong_share", "calibrating the strong share needs at least one request")
    k = round(strong_share * len(ordered))
    if k == 0:
        return float(np.nextafter(ordered[0], math.inf))
    if k >= len(ordered):
        return ordered[-1]
    high, low = ordered[k - 1], ordered[k]
    return high if high == low else (high + low) / 2


def _check_unit(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise RouterConfigError(name, f"{name} must be a number in [0, 1], got {value!r}")

"""The learned router, in the spirit of RouteLLM (Ong et al. 2024, arXiv:2406.18665: a router trained on labelled
requests, its threshold calibrated to a target share of strong-model calls): a scorer over requests the user
labelled easy or hard, on sentence embeddings. Two classifiers (``classifier``):

- ``"knn"`` (default): the share of hard examples among the labelled ones, each weighted by a softmax of its
  cosine similarity s_i to the text at ``temperature`` T (Nadaraya-Watson kernel regression: sum(w_i x hard_i) /
  sum(w_i), w_i = exp(s_i / T)). A small T makes it the label of the nearest examples; unlike a plain
  k-nearest-neighbours vote it gives no ties (many requests with all k neighbours hard score exactly 1), so a
  quantile threshold can split them.
- ``"logistic"``: L2-regularized logistic regression (penalty ``l2`` x ||w||^2 / 2, the intercept unpenalized;
  fitted by Newton's method / IRLS, numpy only) on the embedding plus :func:`text_features` (the text's length in
  words and characters, log-scaled, and the rules' code and math detectors), each feature standardized on the
  examples. The score is P(hard).

The request goes to the strong model when score >= threshold. RouteLLM labels its training requests by outcome
(which model won); labelling "hard" exactly the requests the strong model answers right and the cheap one wrong
points the router at the requests where the strong model pays (the README's routing benchmark).

:meth:`LearnedPolicy.calibrate` sets the threshold from unlabelled calibration texts so that a target share of
them scores at or above it (a quantile); the share on new requests then matches as far as they resemble the
calibration ones. Without calibration texts it uses the examples' own held-out scores: leave-one-out (knn) or
5-fold out-of-fold (logistic).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from leanserve.errors import RouterConfigError
from leanserve.routing.base import RouteDecision, RouteInput
from leanserve.routing.detect import detect_code, detect_math

import numpy as np

LABELS = ("easy", "hard")
CLASSIFIERS = ("knn", "logistic")
CALIBRATION_FOLDS = 5  # logistic: out-of-fold scores of the examples when no calibration texts are given


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
    """A hardness score learned from labelled examples (see the module's docstring); ``strong`` when it reaches
    ``threshold``.

    Args:
        embedder: see :class:`Embedder`; called once here for the examples and once per :meth:`score` call.
        easy_examples, hard_examples: labelled request texts (each non-empty).
        threshold: in [0, 1]; :meth:`calibrate` replaces it.
        temperature: knn: of the similarity softmax (> 0; cosine units).
        classifier: ``"knn"`` or ``"logistic"``.
        l2: logistic: the L2 penalty (> 0), on standardized features.

    Raises:
        RouterConfigError: an empty label, a threshold outside [0, 1], a temperature or l2 that is not > 0, an
            unknown classifier.
    """

    kind = "learned"

    def __init__(self, cheap: str, strong: str, embedder: Embedder, easy_examples: Sequence[str],
                 hard_examples: Sequence[str], threshold: float = 0.5, temperature: float = 0.1,
                 classifier: str = "knn", l2: float = 10.0) -> None:
        if not easy_examples or not hard_examples:
            raise RouterConfigError("examples", "the learned router needs examples of both labels, easy and hard")
        _check_unit("threshold", threshold)
        _check_positive("temperature", temperature)
        _check_positive("l2", l2)
        if classifier not in CLASSIFIERS:
            raise RouterConfigError("classifier", f"classifier must be one of {', '.join(CLASSIFIERS)}, got "
                                    f"{classifier!r}")
        self.cheap, self.strong, self.embedder = cheap, strong, embedder
        self.threshold = float(threshold)
        self.classifier, self.l2 = classifier, float(l2)
        self._texts = list(easy_examples) + list(hard_examples)
        self._vectors = np.asarray(embedder.embed(self._texts), dtype=np.float32)
        self._hard = np.array([0.0] * len(easy_examples) + [1.0] * len(hard_examples), dtype=np.float32)
        self.temperature = float(temperature)
        if classifier == "logistic":
            self._model = fit_logistic(self._features(self._vectors, self._texts), self._hard, self.l2)

    def score(self, texts: Sequence[str]) -> np.ndarray:
        """(len(texts),) float64 hardness scores in [0, 1] (see the module's docstring)."""
        if not texts:
            return np.zeros(0)
        vectors = np.asarray(self.embedder.embed(list(texts)), dtype=np.float32)
        if self.classifier == "logistic":
            return self._model.predict(self._features(vectors, texts))
        return self._score_sims(vectors @ self._vectors.T)

    @staticmethod
    def _features(vectors: np.ndarray, texts: Sequence[str]) -> np.ndarray:
        return np.concatenate([vectors.astype(np.float64), np.array([text_features(t) for t in texts])], axis=1)

    def _score_sims(self, sims: np.ndarray) -> np.ndarray:
        z = sims.astype(np.float64) / self.temperature
        w = np.exp(z - z.max(axis=1, keepdims=True))  # -inf similarities (an excluded example) weigh 0
        return (w @ self._hard.astype(np.float64)) / w.sum(axis=1)

    def example_scores(self) -> np.ndarray:
        """Held-out scores of the labelled examples themselves, the calibration texts when the user gives no
        others: knn: leave-one-out (each scored without itself); logistic: out-of-fold over
        :data:`CALIBRATION_FOLDS` folds (example i in fold i mod 5 of a fixed seed-0 permutation, each fold scored
        by a model fitted on the others; a fold whose rest lacks a label scores with the full model)."""
        if self.classifier == "knn":
            sims = self._vectors @ self._vectors.T
            np.fill_diagonal(sims, -np.inf)
            return self._score_sims(sims)
        x = self._features(self._vectors, self._texts)
        n = len(x)
        order = np.random.default_rng(0).permutation(n)
        scores = self._model.predict(x)
        for k in range(min(CALIBRATION_FOLDS, n)):
            test = order[k::CALIBRATION_FOLDS]
            train = np.setdiff1d(order, test)
            if len(set(self._hard[train].tolist())) == 2:
                scores[test] = fit_logistic(x[train], self._hard[train], self.l2).predict(x[test])
        return scores

    def decide(self, request: RouteInput) -> RouteDecision:
        return self._decision(float(self.score([request.text])[0]))

    def decide_many(self, requests: Sequence[RouteInput]) -> list[RouteDecision]:
        """:meth:`decide` for each request, their texts embedded in one ``embed`` call (a completion batch)."""
        return [self._decision(float(s)) for s in self.score([r.text for r in requests])]

    def _decision(self, s: float) -> RouteDecision:
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


def text_features(text: str) -> list[float]:
    """The logistic classifier's features beyond the embedding: [log(1 + words), log(1 + characters), 1.0 if
    :func:`~leanserve.routing.detect.detect_code` finds code else 0.0, the same for
    :func:`~leanserve.routing.detect.detect_math`]. The counts are of the whole text (linear, C-speed); the
    detectors read its bounded window (:func:`~leanserve.routing.detect.window`: the first and last
    ``WINDOW_CHARS`` characters), so a megabyte text costs milliseconds."""
    return [math.log1p(len(text.split())), math.log1p(len(text)), float(detect_code(text) is not None),
            float(detect_math(text) is not None)]


class LogisticModel:
    """A fitted :func:`fit_logistic` model: standardization (mean, scale) and weights (intercept last)."""

    def __init__(self, mean: np.ndarray, scale: np.ndarray, weights: np.ndarray) -> None:
        self.mean, self.scale, self.weights = mean, scale, weights

    def predict(self, x: np.ndarray) -> np.ndarray:
        """(n,) float64 probabilities of label 1 for (n, d) features."""
        z = (np.asarray(x, dtype=np.float64) - self.mean) / self.scale @ self.weights[:-1] + self.weights[-1]
        return 0.5 * (1.0 + np.tanh(0.5 * z))  # the logistic function, without overflow


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float, max_iter: int = 100, tol: float = 1e-10) -> LogisticModel:
    """L2-regularized logistic regression by Newton's method (IRLS): minimizes sum_i log-loss(y_i, sigmoid(w . z_i
    + b)) + l2 x ||w||^2 / 2 over standardized features z (each column minus its mean, over its standard deviation;
    a constant column gets scale 1); the intercept b is not penalized. ``x``: (n, d), ``y``: (n,) of 0 / 1; stops
    when the step's largest component is under ``tol`` or after ``max_iter`` steps (the penalty makes the problem
    strictly convex for l2 > 0, so Newton converges from 0 in a few steps)."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    mean = x.mean(axis=0)
    scale = x.std(axis=0)
    scale = np.where(scale > 1e-12, scale, 1.0)
    z = np.concatenate([(x - mean) / scale, np.ones((len(x), 1))], axis=1)
    penalty = np.full(z.shape[1], float(l2))
    penalty[-1] = 0.0
    w = np.zeros(z.shape[1])
    for _ in range(max_iter):
        p = 0.5 * (1.0 + np.tanh(0.5 * (z @ w)))
        gradient = z.T @ (p - y) + penalty * w
        hessian = (z * (p * (1.0 - p))[:, None]).T @ z + np.diag(penalty) + 1e-9 * np.eye(z.shape[1])
        step = np.linalg.solve(hessian, gradient)
        w -= step
        if np.abs(step).max() < tol:
            break
    return LogisticModel(mean, scale, w)


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0 or not math.isfinite(value):
        raise RouterConfigError(name, f"{name} must be a number > 0, got {value!r}")


def _check_unit(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise RouterConfigError(name, f"{name} must be a number in [0, 1], got {value!r}")

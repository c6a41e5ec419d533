"""Each router policy's decision on fixed inputs and scores (exact expected results), the calibration helpers, and
the factory's errors. No model runs; the learned policy uses a fake embedder with fixed vectors."""

from __future__ import annotations

import json
import math

from leanserve.config import ServerConfig
from leanserve.errors import InvalidParameterError, RouterConfigError
from leanserve.routing import (
    CascadePolicy,
    LearnedPolicy,
    RouteDecision,
    RouteInput,
    RulesPolicy,
    build_router,
    calibrate_min_mean_logprob,
    detect_code,
    detect_math,
    load_router_specs,
    parse_router_flag,
    threshold_for_share,
)
from leanserve.routing.learned import fit_logistic, text_features

import numpy as np
import pytest

# --- detectors and rules ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "why"), [
    ("What does this print?\n```python\nprint(1)\n```", "fenced code"),
    ("Fix it:\ndef area(r):\n    return 3.14 * r * r", "code line"),
    ("#include <stdio.h>\nint main() {}", "code line"),
    ("why does x = len(s); print(x) fail when s is None", "code keywords"),
    ("Where does Alice live? She lives in Paris (France).", None),
    ("I want to return this item, for a refund in cash.", None),  # "return" in prose, no code punctuation
])
def test_detect_code(text, why):
    assert detect_code(text) == why


@pytest.mark.parametrize(("text", "why"), [
    ("Compute (17 * 4) - 9 + 23.", "arithmetic expression"),
    ("What is 12 * 4?", "arithmetic expression"),
    ("Solve $x^2 = 4$", "latex"),
    ("What is \\frac{1}{2} of it", "latex"),
    ("Please calculate the total of 3 boxes", "math verb with numbers"),
    ("What is 2 + 3?", None),  # one operator, one-digit operands: not worth the strong model
    ("Call me at 555-1234 tomorrow", "arithmetic expression"),  # a known false positive of a regex detector
    ("Repeat exactly: apple river", None),
])
def test_detect_math(text, why):
    assert detect_math(text) == why


def test_rules_decisions_in_order():
    p = RulesPolicy("small", "big", max_cheap_prompt_tokens=100, max_cheap_max_tokens=50)
    long_code = RouteInput("```x```", prompt_tokens=101, max_tokens=500)
    assert p.decide(long_code) == RouteDecision("big", "rules", "rules: prompt of 101 tokens > 100")
    assert p.decide(RouteInput("hi", 100, 51)) == RouteDecision("big", "rules", "rules: max_tokens 51 > 50")
    assert p.decide(RouteInput("hi", 100, None)) == RouteDecision("small", "rules", "rules: no rule matched")
    assert p.decide(RouteInput("```x```", 10, 50)).reason == "rules: code in prompt (fenced code)"
    assert p.decide(RouteInput("Compute 12 * 4", 10, 50)).reason == "rules: math in prompt (arithmetic expression)"
    off = RulesPolicy("small", "big", code=False, math=False)
    assert off.decide(RouteInput("```x``` 12 * 4", 10_000, 10_000)).model == "small"


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"max_cheap_prompt_tokens": 0}, "max_cheap_prompt_tokens"),
    ({"max_cheap_max_tokens": 2.5}, "max_cheap_max_tokens"),
    ({"code": "yes"}, "code"),
])
def test_rules_bad_parameters(kwargs, param):
    with pytest.raises(RouterConfigError) as e:
        RulesPolicy("a", "b", **kwargs)
    assert e.value.param == param


# --- learned --------------------------------------------------------------------------------------------------------


class FakeEmbedder:
    """Fixed unit vectors by text (2-D, so similarities are cosines of chosen angles)."""

    def __init__(self, table: dict[str, tuple[float, float]]) -> None:
        self.table = table
        self.calls = 0

    def embed(self, texts):
        self.calls += 1
        v = np.array([self.table[t] for t in texts], dtype=np.float32)
        return v / np.linalg.norm(v, axis=1, keepdims=True)


def _angle(deg: float) -> tuple[float, float]:
    return (math.cos(math.radians(deg)), math.sin(math.radians(deg)))


EASY = {"e1": _angle(0), "e2": _angle(10)}
HARD = {"h1": _angle(90), "h2": _angle(80)}


def _learned(temperature=0.1, threshold=0.5, extra=None):
    table = {**EASY, **HARD, **(extra or {})}
    return LearnedPolicy("small", "big", FakeEmbedder(table), list(EASY), list(HARD), threshold=threshold,
                         temperature=temperature)


def _expected(angle: float, temperature: float) -> float:
    """The score by hand: softmax weights of the cosines to e1 (0 deg), e2 (10), h1 (90), h2 (80)."""
    w = {name: math.exp(math.cos(math.radians(angle - a)) / temperature)
         for name, a in (("e1", 0), ("e2", 10), ("h1", 90), ("h2", 80))}
    return (w["h1"] + w["h2"]) / sum(w.values())


def test_learned_score_is_similarity_weighted_hard_share():
    angles = {"q45": 45, "q0": 0, "q85": 85, "q225": 225}
    p = _learned(extra={k: _angle(a) for k, a in angles.items()})
    got = p.score(list(angles))
    np.testing.assert_allclose(got, [_expected(a, 0.1) for a in angles.values()], rtol=1e-5)
    assert got[0] == pytest.approx(0.5, abs=1e-6)  # midway between the labels
    assert got[1] < 0.01 and got[2] > 0.99  # near the easy / the hard examples
    assert got[3] == pytest.approx(0.5, abs=1e-6)  # opposite of 45 deg: as far from both labels
    near = _learned(extra={"q84": _angle(84), "q88": _angle(88)})
    a, b = near.score(["q84", "q88"])  # both with every near neighbour hard, yet not tied (kNN: both 1.0)
    assert 0.99 < a < 1.0 and 0.99 < b < 1.0 and a != b
    wide = _learned(temperature=10.0, extra={"q85": _angle(85)})  # a large temperature flattens the weights
    assert wide.score(["q85"])[0] == pytest.approx(_expected(85, 10.0), rel=1e-5)
    assert 0.5 < wide.score(["q85"])[0] < 0.53


def test_learned_decisions_at_the_threshold():
    p = _learned(threshold=0.5, extra={"q60": _angle(60), "q0": _angle(0)})
    s60 = float(p.score(["q60"])[0])
    assert s60 == pytest.approx(_expected(60, 0.1), rel=1e-5) and s60 > 0.5
    p.threshold = s60  # score >= threshold: strong
    d = p.decide(RouteInput("q60"))
    assert (d.model, d.policy, d.score) == ("big", "learned", pytest.approx(s60))
    assert d.reason == f"learned: score {s60:.2f} >= threshold {s60:.2f}"
    p.threshold = float(np.nextafter(s60, 1.0))
    assert p.decide(RouteInput("q60")).model == "small"
    d0 = p.decide(RouteInput("q0"))
    assert d0.model == "small" and d0.reason == f"learned: score 0.00 < threshold {p.threshold:.2f}"


def test_threshold_for_share_is_a_quantile():
    scores = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0]
    assert threshold_for_share(scores, 0.3) == pytest.approx(0.65)
    assert sum(s >= 0.65 for s in scores) == 3
    assert threshold_for_share(scores, 1.0) == 0.0
    t0 = threshold_for_share(scores, 0.0)
    assert t0 > 0.9 and sum(s >= t0 for s in scores) == 0
    assert threshold_for_share([0.5, 0.5, 0.5, 0.1], 0.25) == 0.5  # a tie at the cut goes to the strong side
    with pytest.raises(RouterConfigError) as e:
        threshold_for_share(scores, 1.5)
    assert e.value.param == "strong_share"


def test_learned_calibrate_sets_the_threshold():
    texts = {f"t{a}": _angle(a) for a in range(0, 91, 10)}  # 10 texts from easy to hard
    p = _learned(extra=texts)
    t = p.calibrate(list(texts), 0.4)
    scores = p.score(list(texts))
    assert p.threshold == t and int((scores >= t).sum()) == 4
    loo = p.example_scores()  # each example without itself: e1 against e2, h1, h2
    w = [math.exp(math.cos(math.radians(d)) / 0.1) for d in (10, 90, 80)]
    assert loo.shape == (4,) and loo[0] == pytest.approx((w[1] + w[2]) / sum(w), rel=1e-5) and loo[2] > 0.5


def test_learned_bad_parameters():
    emb = FakeEmbedder({**EASY, **HARD})
    for kwargs, param in (({"threshold": 1.5}, "threshold"), ({"temperature": 0}, "temperature")):
        with pytest.raises(RouterConfigError) as e:
            LearnedPolicy("a", "b", emb, list(EASY), list(HARD), **kwargs)
        assert e.value.param == param
    with pytest.raises(RouterConfigError) as e:
        LearnedPolicy("a", "b", emb, [], list(HARD))
    assert e.value.param == "examples"


def test_learned_bad_classifier_and_l2():
    emb = FakeEmbedder({**EASY, **HARD})
    for kwargs, param in (({"classifier": "svm"}, "classifier"), ({"classifier": "logistic", "l2": 0}, "l2"),
                          ({"l2": -1.0}, "l2")):
        with pytest.raises(RouterConfigError) as e:
            LearnedPolicy("a", "b", emb, list(EASY), list(HARD), **kwargs)
        assert e.value.param == param


def test_text_features():
    assert text_features("Compute (23 * 7) - 15 + 48.") == pytest.approx(
        [math.log1p(8), math.log1p(27), 0.0, 1.0])  # 8 words: split on spaces
    assert text_features("def f(x):\n    return x") == pytest.approx([math.log1p(4), math.log1p(22), 1.0, 0.0])


def _logistic_data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(60, 3)) * [1.0, 5.0, 0.2] + [0.0, 2.0, -1.0]
    y = (x[:, 0] + 0.3 * x[:, 1] + rng.normal(scale=1.0, size=60) > 0.5).astype(float)
    return x, y


def test_fit_logistic_is_the_penalized_optimum():
    """At the fitted weights the penalized log-loss' gradient is 0 (its unique minimum), and the weights are
    scikit-learn's (lbfgs on the same standardized features, C = 1 / l2) when it is installed."""
    x, y = _logistic_data()
    m = fit_logistic(x, y, l2=2.0)
    z = (x - x.mean(0)) / x.std(0)
    np.testing.assert_allclose(m.mean, x.mean(0)) and np.testing.assert_allclose(m.scale, x.std(0))
    p = 1 / (1 + np.exp(-(z @ m.weights[:-1] + m.weights[-1])))
    np.testing.assert_allclose(z.T @ (p - y) + 2.0 * m.weights[:-1], 0, atol=1e-8)
    assert abs(float(np.sum(p - y))) < 1e-8  # the unpenalized intercept's gradient
    np.testing.assert_allclose(m.predict(x), p, rtol=1e-12)
    sklearn = pytest.importorskip("sklearn.linear_model")
    ref = sklearn.LogisticRegression(C=1 / 2.0, tol=1e-12, max_iter=10_000).fit(z, y)
    np.testing.assert_allclose(m.weights[:-1], ref.coef_[0], atol=1e-5)
    assert m.weights[-1] == pytest.approx(ref.intercept_[0], abs=1e-5)


def _logistic(threshold=0.5, extra=None):
    table = {**EASY, **HARD, **(extra or {})}
    return LearnedPolicy("small", "big", FakeEmbedder(table), list(EASY), list(HARD), threshold=threshold,
                         classifier="logistic", l2=1.0)


def test_logistic_scores_and_decisions_on_fixed_vectors():
    """The logistic policy's score is the model fitted by hand on the same features (the 2-D fixed vectors plus
    text_features), and it decides strong exactly at score >= threshold."""
    p = _logistic(extra={"q30": _angle(30), "q60": _angle(60), "q85": _angle(85)})
    names = list(EASY) + list(HARD)
    x = np.array([[*FakeEmbedder({**EASY, **HARD}).embed([t])[0], *text_features(t)] for t in names])
    ref = fit_logistic(x, np.array([0, 0, 1, 1.0]), 1.0)
    queries = ["q30", "q60", "q85"]
    xq = np.array([[*_angle(a), *text_features(t)] for t, a in zip(queries, (30, 60, 85), strict=True)])
    got = p.score(queries)
    np.testing.assert_allclose(got, ref.predict(xq), rtol=1e-6)
    assert got[0] < 0.5 < got[1] < got[2]  # nearer the hard examples: higher
    p.threshold = float(got[1])
    d = p.decide(RouteInput("q60"))
    assert (d.model, d.policy, d.score) == ("big", "learned", pytest.approx(got[1]))
    assert d.reason == f"learned: score {got[1]:.2f} >= threshold {got[1]:.2f}"
    p.threshold = float(np.nextafter(got[1], 1.0))
    assert p.decide(RouteInput("q60")).model == "small"


def test_logistic_example_scores_are_out_of_fold():
    """Without calibration texts the logistic policy calibrates on out-of-fold scores: each example scored by a
    model fitted without its fold (5 folds of a seed-0 permutation)."""
    table = {f"e{a}": _angle(a) for a in range(0, 40, 4)} | {f"h{a}": _angle(a) for a in range(52, 92, 4)}
    easy, hard = [t for t in table if t[0] == "e"], [t for t in table if t[0] == "h"]
    p = LearnedPolicy("small", "big", FakeEmbedder(table), easy, hard, classifier="logistic", l2=1.0)
    names = easy + hard
    x = np.array([[*_angle(int(t[1:])), *text_features(t)] for t in names])
    y = np.array([0.0] * len(easy) + [1.0] * len(hard))
    order = np.random.default_rng(0).permutation(len(names))
    expected = np.zeros(len(names))
    for k in range(5):
        test = order[k::5]
        train = np.setdiff1d(order, test)
        expected[test] = fit_logistic(x[train], y[train], 1.0).predict(x[test])
    np.testing.assert_allclose(p.example_scores(), expected, rtol=1e-6)
    t = p.calibrate(None, 0.5)
    assert int((expected >= t).sum()) == 10


# --- cascade --------------------------------------------------------------------------------------------------------


def test_cascade_first_and_judge_at_the_edges():
    p = CascadePolicy("small", "big", min_mean_logprob=-0.5)
    assert p.first(RouteInput("x")) == RouteDecision("small", "cascade", "cascade: cheap model first")
    assert p.decide(RouteInput("x")) == p.first()
    assert p.judge([-0.5, -0.5]) is None  # exactly at the threshold: kept
    assert p.judge([-0.25, -0.75]) is None  # mean -0.5
    esc = p.judge([-0.5, -0.5000001])
    assert esc is not None and esc.model == "big" and esc.score == pytest.approx(-0.50000005)
    assert esc.reason == "cascade: mean logprob -0.50 < -0.50, escalated"
    empty = p.judge([])
    assert empty.model == "big" and empty.score == -math.inf and "empty" in empty.reason
    assert p.kept([-0.1]).model == "small"


def test_cascade_calibration():
    answers = [[-0.1], [-0.2, -0.4], [-1.0], [-2.0, -4.0], []]  # means -0.1, -0.3, -1, -3, -inf
    t = calibrate_min_mean_logprob(answers, 0.4)  # 2 of 5: the empty one and -3
    assert t == pytest.approx(-2.0)
    p = CascadePolicy("s", "b", t)
    assert [p.judge(a) is not None for a in answers] == [False, False, False, True, True]
    assert calibrate_min_mean_logprob(answers, 0.2) == pytest.approx(-3.0)  # only the empty one
    assert calibrate_min_mean_logprob(answers, 1.0) == 0.0
    with pytest.raises(RouterConfigError):
        calibrate_min_mean_logprob(answers, -0.1)
    for bad in (0.5, math.nan, "x"):
        with pytest.raises(RouterConfigError) as e:
            CascadePolicy("s", "b", bad)
        assert e.value.param == "min_mean_logprob"


# --- factory and config -------------------------------------------------------------------------------------------


def _write_examples(path):
    rows = [{"text": t, "label": "easy"} for t in EASY] + [{"text": t, "label": "hard"} for t in HARD]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_flag_to_policies(tmp_path):
    _write_examples(tmp_path / "ex.jsonl")
    emb = FakeEmbedder({**EASY, **HARD})
    rules = build_router(parse_router_flag("rules", "small", "big"))
    assert isinstance(rules, RulesPolicy) and (rules.cheap, rules.strong) == ("small", "big")
    cascade = build_router(parse_router_flag("cascade:-0.7", "small", "big"))
    assert isinstance(cascade, CascadePolicy) and cascade.min_mean_logprob == -0.7
    spec = parse_router_flag(f"learned:{tmp_path / 'ex.jsonl'}", "small", "big", strong_share=0.5)
    assert spec.name == "auto" and spec.params["strong_share"] == 0.5
    learned = build_router(spec, embedder=emb, served_models=["small", "big"])
    assert isinstance(learned, LearnedPolicy)
    assert int((learned.example_scores() >= learned.threshold).sum()) == 2  # 2 of the 4 examples


@pytest.mark.parametrize(("flag", "message"), [
    ("fancy", "unknown policy"), ("learned", "needs its examples file"), ("cascade:abc", "must be a number"),
    ("rules:5", "takes no argument"),
])
def test_bad_flags(flag, message):
    with pytest.raises(RouterConfigError, match=message) as e:
        parse_router_flag(flag, "small", "big")
    assert e.value.param == "model_router"


def test_routers_file(tmp_path):
    _write_examples(tmp_path / "ex.jsonl")
    doc = {"routers": [
        {"name": "fast", "policy": "rules", "cheap": "s", "strong": "b", "max_cheap_prompt_tokens": 64},
        {"name": "smart", "policy": "learned", "cheap": "s", "strong": "b", "examples": "ex.jsonl",
         "temperature": 0.2},
        {"name": "frugal", "policy": "cascade", "cheap": "s", "strong": "b", "min_mean_logprob": -1.5},
    ]}
    (tmp_path / "r.json").write_text(json.dumps(doc))
    (tmp_path / "r.yaml").write_text("- {name: fast, policy: rules, cheap: s, strong: b, math: false}\n")
    specs = load_router_specs(tmp_path / "r.json")
    assert [s.name for s in specs] == ["fast", "smart", "frugal"]
    assert specs[1].params["examples"] == str(tmp_path / "ex.jsonl")  # relative to the file
    policies = [build_router(s, embedder=FakeEmbedder({**EASY, **HARD})) for s in specs]
    assert policies[0].max_cheap_prompt_tokens == 64 and policies[1].temperature == 0.2
    assert policies[2].min_mean_logprob == -1.5
    (yaml_spec,) = load_router_specs(tmp_path / "r.yaml")
    assert build_router(yaml_spec).math is False


@pytest.mark.parametrize(("routers", "param"), [
    ([{"name": "x", "policy": "rules", "cheap": "s"}], "routers[0].strong"),
    ([{"name": "x", "policy": "magic", "cheap": "s", "strong": "b"}], "routers[0].policy"),
    ([{"name": "x", "policy": "rules", "cheap": "s", "strong": "b", "threshold": 1}], "routers[0].threshold"),
    ([{"name": "x", "policy": "learned", "cheap": "s", "strong": "b"}], "routers[0].examples"),
    ([{"name": "x", "policy": "rules", "cheap": "s", "strong": "s"}], "routers[0].strong"),
    ([{"name": "x", "policy": "rules", "cheap": "s", "strong": "b"}] * 2, "routers[1].name"),
    (["rules"], "routers[0]"),
    ([], "model_routers_file"),
])
def test_bad_routers_file(tmp_path, routers, param):
    (tmp_path / "r.json").write_text(json.dumps(routers))
    with pytest.raises(RouterConfigError) as e:
        load_router_specs(tmp_path / "r.json")
    assert e.value.param == param


def test_bad_values_are_named_at_build(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps([
        {"name": "c", "policy": "cascade", "cheap": "s", "strong": "b", "min_mean_logprob": 2}]))
    (spec,) = load_router_specs(tmp_path / "r.json")
    with pytest.raises(RouterConfigError) as e:
        build_router(spec)
    assert e.value.param == "c.min_mean_logprob"
    with pytest.raises(RouterConfigError) as e:
        build_router(spec, served_models=["s", "other"])
    assert e.value.param == "c.strong"


@pytest.mark.parametrize(("params", "param"), [
    ({"embedding": "bert"}, "l.embedding"), ({"classifier": "tree"}, "l.classifier"),
    ({"classifier": "logistic", "l2": -2}, "l.l2"),
])
def test_bad_learned_values_are_named_at_build(tmp_path, params, param):
    (tmp_path / "ex.jsonl").write_text('{"text": "e1", "label": "easy"}\n{"text": "h1", "label": "hard"}\n')
    (tmp_path / "r.json").write_text(json.dumps([
        {"name": "l", "policy": "learned", "cheap": "s", "strong": "b", "examples": "ex.jsonl", **params}]))
    (spec,) = load_router_specs(tmp_path / "r.json")
    with pytest.raises(RouterConfigError) as e:
        build_router(spec, embedder=FakeEmbedder({**EASY, **HARD}))
    assert e.value.param == param


def test_routers_file_logistic(tmp_path):
    (tmp_path / "ex.jsonl").write_text("".join(json.dumps({"text": t, "label": lab}) + "\n" for t, lab in
                                               (("e1", "easy"), ("e2", "easy"), ("h1", "hard"), ("h2", "hard"))))
    (tmp_path / "r.json").write_text(json.dumps([
        {"name": "l", "policy": "learned", "cheap": "s", "strong": "b", "examples": "ex.jsonl",
         "classifier": "logistic", "l2": 0.5, "threshold": 0.5}]))
    (spec,) = load_router_specs(tmp_path / "r.json")
    p = build_router(spec, embedder=FakeEmbedder({**EASY, **HARD, "q85": _angle(85), "q5": _angle(5)}))
    assert (p.classifier, p.l2, p.threshold) == ("logistic", 0.5, 0.5)
    assert p.decide(RouteInput("q85")).model == "b" and p.decide(RouteInput("q5")).model == "s"


@pytest.mark.parametrize(("lines", "param"), [
    (['{"text": "a", "label": "medium"}'], "ex.jsonl:1.label"),
    (['{"text": "a", "label": "easy"}', "", "not json"], "ex.jsonl:3"),
    (['{"text": "", "label": "easy"}'], "ex.jsonl:1.text"),
    (['{"text": "a", "label": "easy"}'], "examples"),  # no hard example
])
def test_bad_examples_file(tmp_path, lines, param):
    (tmp_path / "ex.jsonl").write_text("\n".join(lines) + "\n")
    spec = parse_router_flag(f"learned:{tmp_path / 'ex.jsonl'}", "s", "b")
    with pytest.raises(RouterConfigError) as e:
        build_router(spec, embedder=FakeEmbedder({"a": (1.0, 0.0)}))
    assert e.value.param == f"auto.{param}"


def test_server_config_fields():
    cfg = ServerConfig(model_router="learned:x.jsonl", strong_share=0.3, model_routers_file="r.yaml")
    assert (cfg.model_router, cfg.strong_share, cfg.model_routers_file) == ("learned:x.jsonl", 0.3, "r.yaml")
    for kwargs, param in (({"model_router": "magic"}, "model_router"), ({"strong_share": 1.2}, "strong_share")):
        with pytest.raises(InvalidParameterError) as e:
            ServerConfig(**kwargs)
        assert e.value.param == param


def test_route_input_from_chat():
    messages = [{"role": "system", "content": "Be brief. 12 * 4"},
                {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Hi"},
                {"role": "user", "content": [{"type": "text", "text": "Compute 17 * 4"},
                                             {"type": "image_url", "image_url": {"url": "x"}}]}]
    inp = RouteInput.from_chat(messages, prompt_tokens=40, max_tokens=8)
    assert inp == RouteInput("Hello\nCompute 17 * 4", 40, 8)
    assert RouteInput.from_chat([{"role": "system", "content": "x"}]).text == ""


def test_a_batch_is_embedded_in_one_call():
    """decide_many (a completion batch routed by a learned router) embeds every prompt in one embed call and
    decides as decide does, prompt by prompt."""
    from leanserve.entrypoints.openai.model_routing import _decide
    from leanserve.routing import RouteInput

    p = _learned(extra={"q5": _angle(5), "q85": _angle(85), "q45": _angle(45)})
    inputs = [RouteInput(t) for t in ("q5", "q85", "q45")]
    one_by_one = [p.decide(i) for i in inputs]
    p.embedder.calls = 0
    assert p.decide_many(inputs) == one_by_one
    assert p.embedder.calls == 1
    assert [d.model for d in one_by_one] == ["small", "big", "big"]  # q45 scores 0.5 = the threshold

    class Router:  # what _decide reads of a ServedRouter
        policy = p

        def route_inputs(self, req, models):
            return inputs

    p.embedder.calls = 0
    assert _decide(Router(), None, None) == (inputs, one_by_one) and p.embedder.calls == 1

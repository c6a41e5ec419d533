"""The speculation policy: drafts are verified while they raise expected tokens per second."""

from __future__ import annotations

from leanserve.spec_decode.policy import PRIOR_ACCEPTANCE, SpeculationPolicy, StepCostModel

import pytest


def test_cost_model_interpolates_extrapolates_and_is_monotone():
    cost = StepCostModel({1: 1.0, 4: 2.0, 8: 1.5})  # a noisy 8-row point below the 4-row one
    assert cost(1) == 1.0 and cost(4) == 2.0 and cost(8) == 2.0
    assert cost(2) == pytest.approx(1 + 1 / 3)
    assert cost(16) == 2.0  # flat last segment extended
    assert StepCostModel({2: 4.0})(4) == 8.0  # one point: proportional to rows


def test_free_rows_verify_every_likely_draft_and_costly_rows_none():
    free = SpeculationPolicy(StepCostModel({1: 1.0, 64: 1.0001}))
    assert free.plan(2, {"a": 4, "b": 3}) == {"a": 4, "b": 3}
    linear = SpeculationPolicy(StepCostModel({1: 1.0, 64: 64.0}))  # each row costs as much as a token is worth
    assert linear.plan(32, {"a": 4, "b": 4}) == {"a": 0, "b": 0}


def test_acceptance_rate_decides_who_gets_rows():
    # rows cost 0.3 of a one-row step each: only drafts likely enough are worth it
    policy = SpeculationPolicy(StepCostModel({1: 1.0, 2: 1.3, 3: 1.6, 4: 1.9, 5: 2.2, 6: 2.5}))
    for _ in range(20):
        policy.observe("good", 4, 4)  # always accepted
        policy.observe("bad", 4, 0)  # always rejected at once
    assert policy.acceptance_rate("good") > 0.9 > 0.1 > policy.acceptance_rate("bad")
    plan = policy.plan(2, {"good": 4, "bad": 4})
    assert plan["bad"] == 0 and plan["good"] >= 2
    assert policy.acceptance_rate("new") == PRIOR_ACCEPTANCE


def test_without_a_cost_model_every_draft_is_verified():
    assert SpeculationPolicy(None).plan(3, {"a": 2}) == {"a": 2}


def test_draft_model_k_weighs_both_models_steps():
    target = StepCostModel({1: 10.0, 64: 10.0})  # verification rows are free
    policy = SpeculationPolicy(target, draft_cost=StepCostModel({1: 1.0, 64: 1.0}))
    for _ in range(20):
        policy.observe("r", 4, 4)
    assert policy.plan_draft_model(1, ["r"], 4) == 4  # cheap, accurate drafts: all of them
    slow_draft = SpeculationPolicy(target, draft_cost=StepCostModel({1: 20.0, 64: 20.0}))
    assert slow_draft.plan_draft_model(1, ["r"], 4) == 4  # not measured yet: one full run to learn its rate
    slow_draft.observe("r", 4, 4)
    assert slow_draft.plan_draft_model(1, ["r"], 4) == 0  # a draft step costs more than a target step
    assert SpeculationPolicy(None).plan_draft_model(2, ["a"], 3) == 3 and SpeculationPolicy(None).plan_draft_model(
        2, [], 3) == 0

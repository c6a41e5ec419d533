"""Router definitions against the served models (entrypoints/openai/model_routing.py ``router_specs``), checked
before any model loads."""

from __future__ import annotations

import json

from leanserve.config import ServerConfig
from leanserve.entrypoints.openai.model_routing import router_specs
from leanserve.errors import RouterConfigError

import pytest


def test_the_flag_routes_between_the_first_two_models():
    (spec,) = router_specs(ServerConfig(model_router="cascade:-0.5"), ["small", "big", "other"])
    assert (spec.name, spec.policy, spec.cheap, spec.strong, spec.params) == (
        "auto", "cascade", "small", "big", {"min_mean_logprob": -0.5})


def test_the_flag_needs_two_models():
    with pytest.raises(RouterConfigError, match="two served models") as e:
        router_specs(ServerConfig(model_router="rules"), ["only"])
    assert e.value.param == "model_router"


@pytest.mark.parametrize("routers,param,message", [
    ([{"name": "r", "policy": "rules", "cheap": "small", "strong": "huge"}], "r.strong", "'huge' is not served"),
    ([{"name": "big", "policy": "rules", "cheap": "small", "strong": "big"}], "model_routers_file", "taken"),
    ([{"name": "auto", "policy": "rules", "cheap": "small", "strong": "big"}], "model_routers_file", "taken"),
])
def test_a_routers_file_is_checked_against_the_served_models(tmp_path, routers, param, message):
    path = tmp_path / "routers.json"
    path.write_text(json.dumps(routers))
    with pytest.raises(RouterConfigError, match=message) as e:
        router_specs(ServerConfig(model_router="rules", model_routers_file=str(path)), ["small", "big"])
    assert e.value.param == param

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


def test_strong_share_needs_a_learned_router():
    with pytest.raises(RouterConfigError, match="learned") as e:
        router_specs(ServerConfig(model_router="rules", strong_share=0.3), ["small", "big"])
    assert e.value.param == "strong_share"


def test_a_routed_request_goes_to_the_model_that_can_serve_it():
    """A chat routed to a model without a chat template, or a request past its context, goes to the other model
    when that one can serve it (and the reason says so); when neither can, the decision stands (the model's own
    error follows)."""
    from types import SimpleNamespace

    from leanserve.entrypoints.openai.model_routing import _servable
    from leanserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    from leanserve.routing import RouteDecision, RouteInput

    def model(name: str, template: str | None, max_len: int):
        return SimpleNamespace(name=name, engine=SimpleNamespace(tokenizer=SimpleNamespace(chat_template=template),
                                                                 max_model_len=max_len))

    models = {"chat": model("chat", "{{ x }}", 100), "base": model("base", None, 1000)}
    registry = SimpleNamespace(get=models.get)
    chat = ChatCompletionRequest(model="auto", messages=[{"role": "user", "content": "hi"}])
    comp = CompletionRequest(model="auto", prompt="hi")
    to_base = RouteDecision("base", "rules", "rules: code in prompt")
    moved = _servable(to_base, "chat", chat, RouteInput("hi", 10, 8), registry)
    assert moved.model == "chat" and moved.reason == "rules: code in prompt; base has no chat template, so chat"
    assert _servable(to_base, "chat", comp, RouteInput("hi", 10, 8), registry) == to_base
    to_chat = RouteDecision("chat", "rules", "rules: no rule matched")
    longer = _servable(to_chat, "base", comp, RouteInput("hi", 95, 10), registry)
    assert longer.model == "base" and "chat holds 100 tokens, the request needs 105" in longer.reason
    # neither can: a chat past the chat model's context stays where the policy sent it
    assert _servable(to_chat, "base", chat, RouteInput("hi", 95, 10), registry) == to_chat


def _kv_model(name: str, max_len: int, blocks: int, block_size: int = 16):
    from types import SimpleNamespace
    admission = SimpleNamespace(block_size=block_size, num_blocks=blocks, kv_capacity_tokens=blocks * block_size)
    return SimpleNamespace(name=name, engine=SimpleNamespace(tokenizer=SimpleNamespace(chat_template="t"),
                                                             max_model_len=max_len,
                                                             engine=SimpleNamespace(admission=admission)))


def test_the_fit_check_counts_the_kv_pool_as_admission_does():
    """A request that fits a model's context but not its KV pool (admission's kv_cache_capacity_exceeded) goes to
    the other model; when neither fits, the first choice (and so its error) stays."""
    from types import SimpleNamespace

    from leanserve.entrypoints.openai.model_routing import _servable
    from leanserve.entrypoints.openai.protocol import CompletionRequest
    from leanserve.routing import RouteDecision, RouteInput

    models = {"small-kv": _kv_model("small-kv", 2048, 10), "big-kv": _kv_model("big-kv", 2048, 100)}
    registry = SimpleNamespace(get=models.get)
    comp = CompletionRequest(model="auto", prompt="hi")
    to_small = RouteDecision("small-kv", "rules", "rules: no rule matched")
    assert _servable(to_small, "big-kv", comp, RouteInput("hi", 100, 60), registry) == to_small  # 160 = 10 x 16
    moved = _servable(to_small, "big-kv", comp, RouteInput("hi", 100, 61), registry)
    assert moved.model == "big-kv" and "small-kv holds 160 tokens of KV cache, the request needs 161" in moved.reason
    assert _servable(to_small, "big-kv", comp, RouteInput("hi", 160, None), registry).model == "big-kv"  # prompt + 1
    assert _servable(to_small, "big-kv", comp, RouteInput("hi", 159, None), registry) == to_small
    assert _servable(to_small, "big-kv", comp, RouteInput("hi", 1000, 1000), registry) == to_small  # neither fits


class _Vocab:
    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab_size, self._vocab = len(vocab), vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)


def test_token_id_prompts_need_one_vocabulary():
    """A router whose models' tokenizers differ refuses token-id prompts (400 naming ``prompt``); text passes."""
    from types import SimpleNamespace

    from leanserve.entrypoints.openai.model_routing import ServedRouter, same_vocabulary
    from leanserve.entrypoints.openai.protocol import CompletionRequest
    from leanserve.entrypoints.openai.serving_common import OpenAIError
    from leanserve.routing import RouterSpec

    a, b = _Vocab({"a": 0, "b": 1}), _Vocab({"a": 1, "b": 0})
    assert same_vocabulary(a, a) and same_vocabulary(a, _Vocab({"b": 1, "a": 0})) and not same_vocabulary(a, b)
    assert not same_vocabulary(a, _Vocab({"a": 0}))
    tokenizer = SimpleNamespace(encode=lambda text: [0] * len(text), decode=lambda ids: "x" * len(ids))
    cheap = SimpleNamespace(engine=SimpleNamespace(tokenizer=tokenizer))
    models = SimpleNamespace(get=lambda name: cheap)
    router = ServedRouter(RouterSpec("auto", "rules", "c", "s"), None, None, None, shared_vocab=False)
    assert router.route_inputs(CompletionRequest(model="auto", prompt="hi"), models)[0].prompt_tokens == 2
    for prompt in ([1, 2], [[1], [2, 3]]):
        with pytest.raises(OpenAIError) as e:
            router.route_inputs(CompletionRequest(model="auto", prompt=prompt), models)
        assert (e.value.status, e.value.param) == (400, "prompt")
        assert "share one tokenizer; send text" in e.value.message


def test_the_routing_decision_runs_off_the_event_loop():
    """serve_routed decides in a worker thread: a slow policy (here 0.4 s) does not stop other coroutines."""
    import asyncio
    import time
    from types import SimpleNamespace

    from leanserve.entrypoints.openai.model_routing import build_routers, serve_routed
    from leanserve.entrypoints.openai.protocol import CompletionRequest
    from leanserve.routing import RouteDecision, RouterSpec

    from fastapi.responses import Response
    from prometheus_client import CollectorRegistry

    class SlowPolicy:
        kind, cheap, strong = "rules", "c", "s"

        def decide(self, request):
            time.sleep(0.4)
            return RouteDecision("c", "rules", "slow")

    spec = RouterSpec("auto", "rules", "c", "s")
    (router,) = build_routers([spec], CollectorRegistry(), {"auto": SlowPolicy()}).values()
    tokenizer = SimpleNamespace(encode=lambda text: [0] * len(text), chat_template=None)
    model = _kv_model("c", 2048, 100)
    model.engine.tokenizer, model.answer_cache = tokenizer, None
    models = SimpleNamespace(get=lambda name: model)
    served = []

    async def create(m, req):
        served.append(req.model)
        return Response(status_code=200)

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        raw = SimpleNamespace(state=SimpleNamespace())
        response = await serve_routed(router, CompletionRequest(model="auto", prompt="hi"), raw, models, create)
        task.cancel()
        return response, ticks

    response, ticks = asyncio.run(main())
    assert response.status_code == 200 and served == ["c"]
    assert ticks >= 10  # the loop kept running while the policy decided (0 when decide runs on the loop)

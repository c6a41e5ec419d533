"""Router models in the server: a virtual model name (``"auto"`` with ``--model-router POLICY``, or each router of
``--model-routers-file``) whose requests a policy of :mod:`leanserve.routing` sends to one of two served models.

- Definitions (:func:`router_specs`): ``--model-router`` routes between the first two served models, in the order
  given (``--model CHEAP --model STRONG``); a routers file names its cheap and strong models. Checked before any
  model loads; the policies (a learned router's embedder and calibration) are built after (:func:`build_routers`).
- Rules and learned routers (:meth:`ServedRouter.decide`): the policy sees the request's user text, its prompt
  length in the cheap model's tokens (chat template included) and ``max_tokens``; the chosen model serves the
  request as if it had been named.
- Cascade (:func:`serve_cascade`): the cheap model answers first, non-streamed with its chosen tokens' logprobs
  (choice 0 is judged); the answer is kept (its logprobs removed unless the client asked for them; a streamed
  request gets it as a stream: one content chunk per choice, then the finish and usage chunks) or the strong
  model answers the original request.
- The response's ``model`` is the model that answered; ``usage.leanserve.route`` says which router decided what
  and why (:class:`~.protocol.RouteUsage`). Counters: ``leanserve:router_requests_total{router, model}`` and
  ``leanserve:router_escalations_total{router}``.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from leanserve import metric_names as names
from leanserve.config import ServerConfig
from leanserve.entrypoints.openai.protocol import ChatCompletionRequest, RouteUsage
from leanserve.entrypoints.openai.served_models import ServedModel, ServedModels
from leanserve.errors import RouterConfigError
from leanserve.routing import (
    RouteDecision,
    RouteInput,
    RouterPolicy,
    RouterSpec,
    build_router,
    load_router_specs,
    parse_router_flag,
)

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter

Create = Callable[[ServedModel, Any], Awaitable[Response]]  # (model, request naming it) -> the serving's response


def router_specs(sc: ServerConfig, served: Sequence[str]) -> list[RouterSpec]:
    """The routers ``sc`` defines over the ``served`` model names (checked, nothing loaded).

    Raises:
        RouterConfigError: ``--model-router`` with fewer than two models, a bad definition, a model not served.
    """
    specs = []
    if sc.strong_share is not None and not (sc.model_router or "").startswith("learned"):
        raise RouterConfigError("strong_share", "--strong-share calibrates a learned router: give it with "
                                "--model-router learned:EXAMPLES.jsonl (a routers file takes strong_share per router)")
    if sc.model_router is not None:
        if len(served) < 2:
            raise RouterConfigError("model_router", "a router needs two served models: give "
                                    "--model CHEAP --model STRONG (the first two models, in that order)")
        specs.append(parse_router_flag(sc.model_router, served[0], served[1], sc.strong_share))
    if sc.model_routers_file is not None:
        specs += load_router_specs(sc.model_routers_file)
    seen = set()
    for i, spec in enumerate(specs):
        if spec.name in seen or spec.name in served:
            from_flag = i == 0 and sc.model_router is not None
            raise RouterConfigError("model_router" if from_flag else "model_routers_file",
                                    f"the router name {spec.name!r} is taken (by a served model or another router)")
        seen.add(spec.name)
        for key in ("cheap", "strong"):
            if getattr(spec, key) not in served:
                raise RouterConfigError(f"{spec.name}.{key}", f"router {spec.name!r}: {key} model "
                                        f"{getattr(spec, key)!r} is not served (served: {', '.join(served)})")
    return specs


@dataclass
class ServedRouter:
    """One router model: its definition, its policy and its counters."""

    spec: RouterSpec
    policy: RouterPolicy
    requests: Counter
    escalations: Counter

    @property
    def name(self) -> str:
        return self.spec.name

    def route_input(self, req: Any, models: ServedModels) -> RouteInput:
        """What the policy sees of ``req``: the user text, the prompt's length in the cheap model's tokens, and
        ``max_tokens`` (``max_completion_tokens`` for chat when given)."""
        tokenizer = models.get(self.spec.cheap).engine.tokenizer
        if isinstance(req, ChatCompletionRequest):
            messages = [m.to_template_dict() for m in req.messages]
            try:
                text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
                tokens = len(tokenizer.encode(text, add_special_tokens=False))
            except Exception:  # a template error is the chosen model's to report, as for a named model
                tokens = 0
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            return RouteInput.from_chat(messages, tokens, max_tokens)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = "\n".join(prompt)
        if isinstance(prompt, str):
            return RouteInput(prompt, len(tokenizer.encode(prompt)), req.max_tokens)
        ids = prompt[0] if prompt and isinstance(prompt[0], list) else prompt or []
        return RouteInput(tokenizer.decode(ids), len(ids), req.max_tokens)

    def usage(self, decision: RouteDecision, escalated_from: str | None = None,
              cheap_completion_tokens: int | None = None) -> RouteUsage:
        return RouteUsage(router=self.name, policy=decision.policy, model=decision.model, reason=decision.reason,
                          score=decision.score, escalated_from=escalated_from,
                          cheap_completion_tokens=cheap_completion_tokens)


def build_policies(specs: Sequence[RouterSpec]) -> dict[str, RouterPolicy]:
    """Router name -> its policy (a learned router loads its embedder and calibrates): before the models load,
    so that a bad value fails at once. Raises RouterConfigError (see :func:`leanserve.routing.build_router`)."""
    return {s.name: build_router(s) for s in specs}


def build_routers(specs: Sequence[RouterSpec], registry: CollectorRegistry,
                  policies: dict[str, RouterPolicy] | None = None) -> dict[str, ServedRouter]:
    """The router models of ``specs`` with counters in ``registry``; ``policies``: built already
    (:func:`build_policies`; default: built here)."""
    if not specs:
        return {}
    policies = policies if policies is not None else build_policies(specs)
    requests = Counter(names.ROUTER_REQUESTS, names.ROUTER_HELP[names.ROUTER_REQUESTS],
                       [names.ROUTER_LABEL, names.MODEL_NAME_LABEL], registry=registry)
    escalations = Counter(names.ROUTER_ESCALATIONS, names.ROUTER_HELP[names.ROUTER_ESCALATIONS],
                          [names.ROUTER_LABEL], registry=registry)
    return {s.name: ServedRouter(s, policies[s.name], requests, escalations) for s in specs}


def _unfit(model: ServedModel, req: Any, inp: RouteInput) -> str | None:
    """Why ``model`` cannot serve ``req`` (a chat request and no chat template; a prompt plus ``max_tokens``
    past its context, counted in the cheap model's tokens), or None."""
    if isinstance(req, ChatCompletionRequest) and getattr(model.engine.tokenizer, "chat_template", None) is None:
        return "has no chat template"
    need = inp.prompt_tokens + (inp.max_tokens or 0)
    if need > model.engine.max_model_len:
        return f"holds {model.engine.max_model_len} tokens, the request needs {need}"
    return None


def _servable(decision: RouteDecision, other: str, req: Any, inp: RouteInput, models: ServedModels
              ) -> RouteDecision:
    """``decision``, or the other model when the chosen one cannot serve the request and the other can."""
    why = _unfit(models.get(decision.model), req, inp)
    if why is None or _unfit(models.get(other), req, inp) is not None:
        return decision
    return RouteDecision(other, decision.policy, f"{decision.reason}; {decision.model} {why}, so {other}",
                         decision.score)


def _pinned(req: Any, model: ServedModel, **update: Any) -> Any:
    return req.model_copy(update={"model": model.name, **update})


async def serve_routed(router: ServedRouter, req: Any, raw_request: Request, models: ServedModels,
                       create: Create) -> Response:
    """Serve ``req`` (sent to ``router``'s name) by the model its policy picks; a cascade by
    :func:`serve_cascade`."""
    if router.policy.kind == "cascade":
        return await serve_cascade(router, req, raw_request, models, create)
    inp = router.route_input(req, models)
    decision = router.policy.decide(inp)
    other = router.spec.strong if decision.model == router.spec.cheap else router.spec.cheap
    decision = _servable(decision, other, req, inp, models)
    return await _serve_by(router, models.get(decision.model), router.usage(decision), req, raw_request, create)


async def _serve_by(router: ServedRouter, model: ServedModel, route: RouteUsage, req: Any, raw_request: Request,
                    create: Create, escalated: bool = False) -> Response:
    """``req`` answered by ``model`` as if named, reported as ``route`` and counted (when answered)."""
    raw_request.state.route = route
    raw_request.state.answer_cache = model.answer_cache
    response = await create(model, _pinned(req, model))
    if response.status_code < 400:
        if escalated:
            router.escalations.labels(router.name).inc()
        router.requests.labels(router.name, model.name).inc()
    return response


def _chosen_logprobs(body: dict, chat: bool, echoed: int = 0) -> list[float]:
    """Choice 0's chosen-token logprobs in a non-streamed response body, the first ``echoed`` entries (an echoed
    prompt's) left out."""
    lp = (body.get("choices") or [{}])[0].get("logprobs") or {}
    if chat:
        return [t["logprob"] for t in lp.get("content") or []]
    return [x for x in (lp.get("token_logprobs") or [])[echoed:] if x is not None]


def _echoed_tokens(req: Any, inp: RouteInput, cheap: ServedModel) -> int:
    """Tokens of a completion request's first prompt that ``echo`` puts before its answer (0 without echo); a
    single prompt's count is ``inp``'s already."""
    if isinstance(req, ChatCompletionRequest) or not getattr(req, "echo", False):
        return 0
    prompt = req.prompt
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
        return inp.prompt_tokens
    first = prompt[0] if prompt else []
    return len(cheap.engine.tokenizer.encode(first)) if isinstance(first, str) else len(first)


async def serve_cascade(router: ServedRouter, req: Any, raw_request: Request, models: ServedModels,
                        create: Create) -> Response:
    """The cheap answer, kept or escalated to the strong model (see the module notes)."""
    policy = router.policy
    chat = isinstance(req, ChatCompletionRequest)
    cheap, strong = models.get(policy.cheap), models.get(policy.strong)
    inp = router.route_input(req, models)
    why_not_cheap, why_not_strong = _unfit(cheap, req, inp), _unfit(strong, req, inp)
    if why_not_cheap is not None and why_not_strong is None:  # only the strong model can: no cheap answer first
        decision = RouteDecision(strong.name, policy.kind, f"cascade: {cheap.name} {why_not_cheap}, so {strong.name}")
        return await _serve_by(router, strong, router.usage(decision), req, raw_request, create)
    probe = _pinned(req, cheap, stream=False, stream_options=None,
                    **({"logprobs": True} if chat else {} if req.logprobs is not None else {"logprobs": 0}))
    raw_request.state.route = router.usage(policy.first())
    raw_request.state.answer_cache = cheap.answer_cache
    response = await create(cheap, probe)
    if response.status_code >= 400:
        return response
    body = json.loads(response.body)
    token_logprobs = _chosen_logprobs(body, chat, _echoed_tokens(req, inp, cheap))
    nothing_asked = req.max_tokens == 0  # an echo of the prompt only: there is no answer to judge
    escalate = None if nothing_asked else policy.judge(token_logprobs)
    if escalate is not None and why_not_strong is not None:  # the strong model cannot answer it: keep the cheap
        kept = RouteDecision(cheap.name, policy.kind, f"{escalate.reason} refused: {strong.name} {why_not_strong}",
                             escalate.score)
        escalate = None
    elif escalate is None:
        kept = policy.kept(token_logprobs) if not nothing_asked else RouteDecision(
            cheap.name, policy.kind, "cascade: max_tokens 0, nothing to judge")
    if escalate is None:
        if chat and not req.logprobs or not chat and req.logprobs is None:
            for choice in body.get("choices", []):
                choice["logprobs"] = None
        leanserve = (body.get("usage") or {}).get("leanserve")
        if leanserve is not None:
            leanserve["route"] = router.usage(kept).model_dump(mode="json")
        router.requests.labels(router.name, cheap.name).inc()
        headers = {k: v for k, v in response.headers.items() if k.lower().startswith("x-")}
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_as_stream(body, chat, include_usage), media_type="text/event-stream",
                                     headers=headers)
        return JSONResponse(body, headers=headers)
    cheap_tokens = (body.get("usage") or {}).get("completion_tokens")
    route = router.usage(escalate, escalated_from=cheap.name, cheap_completion_tokens=cheap_tokens)
    return await _serve_by(router, strong, route, req, raw_request, create, escalated=True)


async def _as_stream(body: dict, chat: bool, include_usage: bool):
    """A non-streamed response body as OpenAI's stream: per choice one chunk with its whole content (chat: role,
    content and tool calls; completions: text and logprobs), then one with its finish reason; then the usage
    chunk when asked; then ``[DONE]``."""
    base = {"id": body["id"], "object": "chat.completion.chunk" if chat else "text_completion",
            "created": body["created"], "model": body["model"]}

    def event(choices: list, usage: Any = None) -> str:
        chunk = {**base, "choices": choices}
        if include_usage:
            chunk["usage"] = usage
        return f"data: {json.dumps(chunk)}\n\n"

    for c in body["choices"]:
        if chat:
            msg = c.get("message") or {}
            delta = {"role": "assistant", "content": msg.get("content")}
            if msg.get("tool_calls"):
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(msg["tool_calls"])]
            yield event([{"index": c["index"], "delta": delta, "logprobs": c.get("logprobs"), "finish_reason": None}])
            yield event([{"index": c["index"], "delta": {}, "logprobs": None, "finish_reason": c["finish_reason"]}])
        else:
            yield event([{"index": c["index"], "text": c.get("text", ""), "logprobs": c.get("logprobs"),
                          "finish_reason": None}])
            yield event([{"index": c["index"], "text": "", "logprobs": None, "finish_reason": c["finish_reason"]}])
    if include_usage:
        yield f"data: {json.dumps({**base, 'choices': [], 'usage': body.get('usage')})}\n\n"
    yield "data: [DONE]\n\n"


"""Router models in the server: a virtual model name (``"auto"`` with ``--model-router POLICY``, or each router of
``--model-routers-file``) whose requests a policy of :mod:`leanserve.routing` sends to one of two served models.

- Definitions (:func:`router_specs`): ``--model-router`` routes between the first two served models, in the order
  given (``--model CHEAP --model STRONG``); a routers file names its cheap and strong models. Checked before any
  model loads; the policies (a learned router's embedder and calibration) are built after (:func:`build_routers`).
- Rules and learned routers (:func:`serve_routed`): the policy sees the request's user text, its prompt
  length in the cheap model's tokens (chat template included) and ``max_tokens``; the chosen model serves the
  request as if it had been named. A completion request with a batch of prompts has each prompt judged; the
  batch is served by one model, the strong one when any prompt goes there (so that one response has one model).
- Cascade (:func:`serve_cascade`): the cheap model answers first, non-streamed with its chosen tokens' logprobs
  (each prompt's first choice is judged; any escalation escalates the whole request); the answer is kept (its
  logprobs removed unless the client asked for them; a streamed request gets it as a stream: one content chunk
  per choice, then the finish chunks, the last with ``timings``, and the usage chunk) or the strong model
  answers the original request. With ``history_summary_tokens`` each model summarizes the turns its own context
  drops, with itself (the strong model's prompt is cut by its own context and tokenizer, and its answer should
  not rest on the cheap model's summary): an escalated request's ``route.cheap_history_summary`` reports the
  cheap model's (computed, or reused from its summary cache).
- The response's ``model`` is the model that answered; ``usage.leanserve.route`` says which router decided what
  and why (:class:`~.protocol.RouteUsage`). Counters: ``leanserve:router_requests_total{router, model_name}`` and
  ``leanserve:router_escalations_total{router}``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from leanserve import metric_names as names
from leanserve.config import ServerConfig
from leanserve.entrypoints.openai.protocol import ChatCompletionRequest, RouteUsage
from leanserve.entrypoints.openai.served_models import ServedModel, ServedModels
from leanserve.entrypoints.openai.serving_common import ARRIVAL_KEY, bad_request
from leanserve.errors import RouterConfigError
from leanserve.routing import (
    RouteDecision,
    RouteInput,
    RouterPolicy,
    RouterSpec,
    build_router,
    load_router_specs,
    mean_logprob,
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
    shared_vocab: bool = True  # the cheap and strong models' tokenizers have one vocabulary (token-id prompts pass)

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
        return self.route_inputs(req, models)[0]

    def route_inputs(self, req: Any, models: ServedModels) -> list[RouteInput]:
        """One :meth:`route_input` per prompt of a completion request (a batch of texts or of token-id lists:
        each its own text and length; token ids decoded by the cheap model's tokenizer); a chat request's one.

        Raises:
            OpenAIError: a 400 (``param`` ``prompt``) for token ids when the router's models do not share one
                vocabulary (:attr:`shared_vocab`).
            InvalidParameterError: ids outside ``[0, V)`` or an empty prompt, as the cheap model's admission says.
        """
        if isinstance(req, ChatCompletionRequest):
            return [self.route_input(req, models)]
        tokenizer = models.get(self.spec.cheap).engine.tokenizer
        prompt = req.prompt
        if isinstance(prompt, str):
            return [RouteInput(prompt, len(tokenizer.encode(prompt)), req.max_tokens)]
        if prompt and isinstance(prompt[0], str):
            return [RouteInput(p, len(tokenizer.encode(p)), req.max_tokens) for p in prompt]
        batches = prompt if prompt and isinstance(prompt[0], list) else [prompt or []]
        if not self.shared_vocab:
            raise bad_request("token-id prompts need a router whose models share one tokenizer; send text",
                              "prompt")
        admission = models.get(self.spec.cheap).engine.engine.admission
        for ids in batches:  # checked as a named model's admission checks them, before decode sees a bad id
            admission.tokenize(ids)
        return [RouteInput(tokenizer.decode(ids), len(ids), req.max_tokens) for ids in batches]

    def usage(self, decision: RouteDecision, escalated_from: str | None = None,
              cheap_completion_tokens: int | None = None, cheap_history_summary: dict | None = None) -> RouteUsage:
        return RouteUsage(router=self.name, policy=decision.policy, model=decision.model, reason=decision.reason,
                          score=decision.score, escalated_from=escalated_from,
                          cheap_completion_tokens=cheap_completion_tokens,
                          cheap_history_summary=cheap_history_summary)


def build_policies(specs: Sequence[RouterSpec]) -> dict[str, RouterPolicy]:
    """Router name -> its policy (a learned router loads its embedder and calibrates): before the models load,
    so that a bad value fails at once. Raises RouterConfigError (see :func:`leanserve.routing.build_router`)."""
    return {s.name: build_router(s) for s in specs}


def build_routers(specs: Sequence[RouterSpec], registry: CollectorRegistry,
                  policies: dict[str, RouterPolicy] | None = None,
                  models: ServedModels | None = None) -> dict[str, ServedRouter]:
    """The router models of ``specs`` with counters in ``registry``; ``policies``: built already
    (:func:`build_policies`; default: built here); ``models``: the served models, whose tokenizers' vocabularies
    are compared once here (:attr:`ServedRouter.shared_vocab`; None: assumed shared)."""
    if not specs:
        return {}
    policies = policies if policies is not None else build_policies(specs)
    requests = Counter(names.ROUTER_REQUESTS, names.ROUTER_HELP[names.ROUTER_REQUESTS],
                       [names.ROUTER_LABEL, names.MODEL_NAME_LABEL], registry=registry)
    escalations = Counter(names.ROUTER_ESCALATIONS, names.ROUTER_HELP[names.ROUTER_ESCALATIONS],
                          [names.ROUTER_LABEL], registry=registry)
    return {s.name: ServedRouter(s, policies[s.name], requests, escalations,
                                 models is None or same_vocabulary(models.get(s.cheap).engine.tokenizer,
                                                                   models.get(s.strong).engine.tokenizer))
            for s in specs}


def same_vocabulary(a: Any, b: Any) -> bool:
    """Whether two tokenizers map the same token strings to the same ids (the same object, or equal
    ``vocab_size`` and ``get_vocab()``)."""
    if a is b:
        return True
    if getattr(a, "vocab_size", None) != getattr(b, "vocab_size", None):
        return False
    return a.get_vocab() == b.get_vocab()


def _unfit(model: ServedModel, req: Any, inp: RouteInput) -> str | None:
    """Why ``model`` cannot serve ``req``, or None: a chat request and no chat template; or, counted in the cheap
    model's tokens, the rule admission applies (:meth:`RequestAdmission.admit`): a prompt plus ``max_tokens``
    past its context, or past its KV pool's token capacity (in whole blocks; without ``max_tokens``, the prompt
    plus one token)."""
    if isinstance(req, ChatCompletionRequest) and getattr(model.engine.tokenizer, "chat_template", None) is None:
        return "has no chat template"
    need = inp.prompt_tokens + (inp.max_tokens or 0)
    if need > model.engine.max_model_len:
        return f"holds {model.engine.max_model_len} tokens, the request needs {need}"
    admission = getattr(getattr(model.engine, "engine", None), "admission", None)
    if admission is not None:
        kv_need = inp.prompt_tokens + (inp.max_tokens or 1)
        if -(-kv_need // admission.block_size) > admission.num_blocks:
            return f"holds {admission.kv_capacity_tokens} tokens of KV cache, the request needs {kv_need}"
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
    inputs, decisions = await asyncio.to_thread(_decide, router, req, models)  # off the event loop
    decision = _batch_decision(decisions, router.spec.strong)
    inp = max(inputs, key=lambda i: i.prompt_tokens)  # the longest prompt decides what fits
    other = router.spec.strong if decision.model == router.spec.cheap else router.spec.cheap
    decision = _servable(decision, other, req, inp, models)
    return await _serve_by(router, models.get(decision.model), router.usage(decision), req, raw_request, create)


def _decide(router: ServedRouter, req: Any, models: ServedModels) -> tuple[list[RouteInput], list[RouteDecision]]:
    """The request's inputs (tokenized) and the policy's decision for each (a batch in one ``decide_many`` call
    where the policy has one: the learned router embeds the batch at once); run in a worker thread."""
    inputs = router.route_inputs(req, models)
    decide_many = getattr(router.policy, "decide_many", None)
    if decide_many is not None and len(inputs) > 1:
        return inputs, list(decide_many(inputs))
    return inputs, [router.policy.decide(i) for i in inputs]


def _batch_decision(decisions: Sequence[RouteDecision], strong: str) -> RouteDecision:
    """One model for a batch of prompts, each judged by the policy: the strong model when any prompt goes there
    (the first such prompt's reason), else the cheap one; ``score``: the highest score (None when none has one)."""
    if len(decisions) == 1:
        return decisions[0]
    up = [i for i, d in enumerate(decisions) if d.model == strong]
    first = up[0] if up else 0
    scores = [d.score for d in decisions if d.score is not None]
    return RouteDecision(decisions[first].model, decisions[first].policy,
                         f"batch of {len(decisions)} prompts, {len(up)} to {strong}; prompt {first}: "
                         f"{decisions[first].reason}", max(scores) if scores else None)


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


def _chosen_logprobs(body: dict, chat: bool, echoed: int = 0, index: int = 0) -> list[float]:
    """The chosen-token logprobs of choice ``index`` in a non-streamed response body, the first ``echoed`` entries
    (an echoed prompt's) left out."""
    choices = {c.get("index"): c for c in body.get("choices") or []}
    lp = (choices.get(index) or {}).get("logprobs") or {}
    if chat:
        return [t["logprob"] for t in lp.get("content") or []]
    return [x for x in (lp.get("token_logprobs") or [])[echoed:] if x is not None]


def _empty_answer(body: dict, chat: bool, req: Any, index: int = 0) -> bool:
    """Whether choice ``index`` of a non-streamed body gives the client no answer: chat: no content (or only
    whitespace) and no tool calls; a completion without ``echo``: an empty (or whitespace) text."""
    choice = {c.get("index"): c for c in body.get("choices") or []}.get(index) or {}
    if chat:
        message = choice.get("message") or {}
        return not (message.get("content") or "").strip() and not message.get("tool_calls")
    return not getattr(req, "echo", False) and not (choice.get("text") or "").strip()


def _echoed_tokens(req: Any, inp: RouteInput) -> int:
    """Tokens of a completion prompt that ``echo`` puts before its answer (0 without echo): ``inp``'s count."""
    if isinstance(req, ChatCompletionRequest) or not getattr(req, "echo", False):
        return 0
    return inp.prompt_tokens


async def serve_cascade(router: ServedRouter, req: Any, raw_request: Request, models: ServedModels,
                        create: Create) -> Response:
    """The cheap answer, kept or escalated to the strong model (see the module notes)."""
    policy = router.policy
    chat = isinstance(req, ChatCompletionRequest)
    cheap, strong = models.get(policy.cheap), models.get(policy.strong)
    inputs = await asyncio.to_thread(router.route_inputs, req, models)  # tokenizing is off the event loop
    inp = max(inputs, key=lambda i: i.prompt_tokens)  # the longest prompt decides what fits
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
    # each prompt's first choice is judged (choices are ordered by prompt, n per prompt); any escalation escalates
    # the batch, and a kept batch reports its least sure answer
    n = getattr(req, "n", None) or 1
    # the answer judged is the text the client gets: one a stop string emptied is an empty answer (escalates)
    answers = [[] if _empty_answer(body, chat, req, k * n) else
               _chosen_logprobs(body, chat, _echoed_tokens(req, i), k * n) for k, i in enumerate(inputs)]
    judged = [policy.judge(a) for a in answers]
    worst = min(range(len(answers)), key=lambda k: mean_logprob(answers[k]))
    token_logprobs = answers[worst]
    nothing_asked = req.max_tokens == 0  # an echo of the prompt only: there is no answer to judge
    up = next((k for k, d in enumerate(judged) if d is not None), None)
    escalate = None if nothing_asked or up is None else judged[up]
    if escalate is not None and len(inputs) > 1:
        escalate = RouteDecision(escalate.model, escalate.policy,
                                 f"batch of {len(inputs)} prompts; prompt {up}: {escalate.reason}", escalate.score)
    if escalate is not None and why_not_strong is not None:  # the strong model cannot answer it: keep the cheap
        kept = RouteDecision(cheap.name, policy.kind, f"{escalate.reason} refused: {strong.name} {why_not_strong}",
                             escalate.score)
        escalate = None
    elif escalate is None:
        kept = policy.kept(token_logprobs) if not nothing_asked else RouteDecision(
            cheap.name, policy.kind, "cascade: max_tokens 0, nothing to judge")
        if len(inputs) > 1 and not nothing_asked:
            kept = RouteDecision(kept.model, kept.policy, f"batch of {len(inputs)} prompts; least sure, prompt "
                                 f"{worst}: {kept.reason}", kept.score)
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
            return StreamingResponse(_as_stream(body, chat, include_usage, raw_request.scope.get(ARRIVAL_KEY)),
                                     media_type="text/event-stream",
                                     headers=headers)
        return JSONResponse(body, headers=headers)
    cheap_tokens = (body.get("usage") or {}).get("completion_tokens")
    # the strong model drops and summarizes turns by its own context and tokenizer, with itself: the cheap
    # model's summary (computed or reused for the cheap answer) is reported, not reused
    cheap_summary = ((body.get("usage") or {}).get("leanserve") or {}).get("history_summary")
    route = router.usage(escalate, escalated_from=cheap.name, cheap_completion_tokens=cheap_tokens,
                         cheap_history_summary=cheap_summary)
    return await _serve_by(router, strong, route, req, raw_request, create, escalated=True)


async def _as_stream(body: dict, chat: bool, include_usage: bool, arrival: float | None = None):
    """A non-streamed response body as OpenAI's stream: per choice one chunk with its whole content (chat: role,
    content and tool calls; completions: text and logprobs), then one with its finish reason (and ``stop_reason``),
    the last of these carrying the body's ``timings`` as every stream's last choice chunk does; then the usage
    chunk when asked; then ``[DONE]``.

    ``timings.ttft_ms`` is the client's: from ``arrival`` (``time.monotonic()``, the request's arrival) to the
    first chunk handed to the server (the cheap answer generated and judged); the other timings are the cheap
    model's. (``vllm:time_to_first_token_seconds`` counts the cheap model's internal request, its first token.)"""
    base = {"id": body["id"], "object": "chat.completion.chunk" if chat else "text_completion",
            "created": body["created"], "model": body["model"]}

    def event(choices: list, usage: Any = None, timings: Any = None) -> str:
        chunk = {**base, "choices": choices}
        if include_usage:
            chunk["usage"] = usage
        if timings is not None:
            chunk["timings"] = timings
        return f"data: {json.dumps(chunk)}\n\n"

    choices = body["choices"]
    first_sent: float | None = None
    for n, c in enumerate(choices):
        finish = {"index": c["index"], "logprobs": None, "finish_reason": c["finish_reason"],
                  "stop_reason": c.get("stop_reason")}
        first_sent = first_sent if first_sent is not None else time.monotonic()  # the next event is sent first
        timings = body.get("timings") if n == len(choices) - 1 else None
        if timings is not None and arrival is not None:
            timings = {**timings, "ttft_ms": (first_sent - arrival) * 1000.0}
        if chat:
            msg = c.get("message") or {}
            delta = {"role": "assistant", "content": msg.get("content")}
            if msg.get("tool_calls"):
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(msg["tool_calls"])]
            yield event([{"index": c["index"], "delta": delta, "logprobs": c.get("logprobs"), "finish_reason": None}])
            yield event([{**finish, "delta": {}}], timings=timings)
        else:
            yield event([{"index": c["index"], "text": c.get("text", ""), "logprobs": c.get("logprobs"),
                          "finish_reason": None}])
            yield event([{**finish, "text": ""}], timings=timings)
    if include_usage:
        yield f"data: {json.dumps({**base, 'choices': [], 'usage': body.get('usage')})}\n\n"
    yield "data: [DONE]\n\n"


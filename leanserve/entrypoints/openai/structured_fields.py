"""The API's structured-output and tool fields -> one :class:`StructuredOutputsParams` per request.

Structured outputs: chat's ``response_format`` (``json_object``, ``json_schema``), and on both endpoints vLLM's
``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) and the older ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``; at most one of them per request. Tools (chat): ``tools``
with ``tool_choice`` ``none`` (tools neither shown nor parsed: plain content), ``auto`` (the default; calls parsed,
each call the model starts kept well formed by the grammar), ``required`` or a named function (forced through the
grammar: only calls, arguments valid under the tool's ``parameters``), and ``parallel_tool_calls``. The grammar
itself is compiled, and checked, at admission.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from leanserve.entrypoints.openai.protocol import ChatCompletionRequest, SamplingFields
from leanserve.entrypoints.openai.serving_common import bad_request, to_openai_error
from leanserve.errors import InvalidParameterError
from leanserve.sampling_params import StructuredOutputsParams
from leanserve.structured.tools import tool_call_structural_tag

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def constraint_of(req: SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's structured-output constraint and the API field that set it (``None, None`` without one).

    Raises:
        OpenAIError: 400 naming the field: two constraints at once, or a malformed one (empty choice, no schema).
    """
    found: list[tuple[str, dict[str, Any]]] = []
    if req.structured_outputs is not None:
        so = req.structured_outputs
        kwargs = {k: v for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                    ("grammar", so.grammar), ("json_object", so.json_object)) if v is not None}
        found.append(("structured_outputs", kwargs))
    for name, key in _GUIDED.items():
        if getattr(req, name) is not None:
            found.append((name, {key: getattr(req, name)}))
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        else:
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise bad_request("response_format of type json_schema needs json_schema.schema", "response_format")
            found.append(("response_format", {"json": fmt.json_schema.schema_}))
    if not found:
        return None, None
    if len(found) > 1:
        raise bad_request(f"at most one structured-output constraint per request, got {[f for f, _ in found]}",
                          found[1][0])
    field, kwargs = found[0]
    if isinstance(kwargs.get("json"), str):
        try:
            json.loads(kwargs["json"])
        except ValueError as exc:
            raise bad_request(f"{field}: the JSON schema is not valid JSON: {exc}", field) from None
    try:
        return StructuredOutputsParams(**kwargs), field
    except InvalidParameterError as exc:
        raise to_openai_error(exc, {"structured_outputs": field}) from None


@dataclass
class ToolPlan:
    """What a chat request does with its tools.

    Attributes:
        tools: the tools shown to the model (plain dicts), or None.
        parse: whether the output is parsed into ``tool_calls``.
        constraint: the grammar that forces or shapes the calls, or None.
    """

    tools: list[dict[str, Any]] | None = None
    parse: bool = False
    constraint: StructuredOutputsParams | None = None


def tool_plan(req: ChatCompletionRequest, has_constraint: bool) -> ToolPlan:
    """The tools plan of ``req``; ``has_constraint``: the request already has a structured-output constraint.

    Raises:
        OpenAIError: 400: ``tool_choice`` without ``tools``, a named function that is not among them, duplicate
            tool names, parameters that are not an object schema, or ``required`` / a named function together
            with another constraint.
    """
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return ToolPlan()
    tools = [t.model_dump(exclude_none=True, by_alias=True) for t in req.tools]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise bad_request(f"tool names must be unique, got {names}", "tools")
    for i, t in enumerate(tools):
        ptype = t["function"].get("parameters", {}).get("type", "object")
        if ptype != "object":  # arguments are a JSON object (OpenAI's function-calling contract)
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema of type object, got type "
                              f"{ptype!r}", "tools")
    if choice == "none":
        return ToolPlan()
    if choice is None or choice == "auto":
        mode, chosen = "auto", tools
    elif choice == "required":
        mode, chosen = "forced", tools
    else:
        chosen = [t for t in tools if t["function"]["name"] == choice.function.name]
        if not chosen:
            raise bad_request(f"tool_choice names the function {choice.function.name!r}, which is not in tools "
                              f"{names}", "tool_choice")
        mode = "forced"
    if has_constraint:
        if mode == "forced":
            raise bad_request("tool_choice required or a named function cannot be combined with another "
                              "structured-output constraint", "tool_choice")
        return ToolPlan(tools, parse=True)
    parallel = req.parallel_tool_calls and chosen is tools
    tag = tool_call_structural_tag(chosen, mode, parallel)
    return ToolPlan(tools, parse=True, constraint=StructuredOutputsParams(structural_tag=json.dumps(tag)))

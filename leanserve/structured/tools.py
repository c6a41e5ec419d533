"""Tool calling in the hermes format (NousResearch Hermes-2-Pro, Qwen2.5): the prompt, the grammar, the parser.

The model calls a tool by writing ``<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`` (several
calls one after the other). Pure Python over plain dicts (OpenAI's ``tools`` / ``messages`` shapes):

- :func:`render_messages`: the conversation for a chat template without tool support (SmolLM2's has none): a
  system-prompt section listing the tools as JSON in ``<tools></tools>`` (hermes style), assistant ``tool_calls``
  written back as ``<tool_call>`` blocks, ``role: "tool"`` results as a user turn of ``<tool_response>`` blocks;
- :func:`tool_call_structural_tag`: the xgrammar structural tag that forces calls (``required`` or a named
  function: only calls, each one's arguments valid under its tool's ``parameters`` schema) or, for ``auto``,
  lets the model write text but makes every call it starts well formed;
- :class:`ToolCallParser`: text (whole, or streamed piece by piece) -> content pieces and tool-call deltas in
  OpenAI's streaming shape; the non-streamed ``tool_calls`` are the same deltas assembled.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_CALL_PREFIX = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_CLOSE_TAIL = re.compile(r"\}\s*(?:<(?:/(?:t(?:o(?:o(?:l(?:_(?:c(?:a(?:l(?:l(?:>)?)?)?)?)?)?)?)?)?)?)?)?$")

TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")


def parameters_of(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's ``parameters`` JSON schema; a tool without parameters takes an empty object."""
    return tool["function"].get("parameters") or NO_PARAMETERS


def render_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The conversation in plain ``{"role", "content"}`` messages for a template that knows no tools.

    Args:
        messages: OpenAI chat messages (content already one string), with assistant ``tool_calls`` (``arguments``
            as JSON text) and ``role: "tool"`` messages.
        tools: OpenAI ``tools`` to list in the system prompt; None or empty: none listed.
    """
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = [f'{TOOL_CALL_START}\n{json.dumps(_call_json(c), ensure_ascii=False)}\n{TOOL_CALL_END}'
                     for c in m["tool_calls"]]
            content = "\n".join(([content] if content else []) + calls)
        elif role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool_results"):  # consecutive results: one user turn
                out[-1]["content"] += "\n" + block
                continue
            out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        out.append({"role": role, "content": content})
    for m in out:
        m.pop("_tool_results", None)
    if tools:
        section = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{section}"}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def _call_json(call: dict[str, Any]) -> dict[str, Any]:
    """A call as the hermes format writes it: ``arguments`` parsed from its JSON text (OpenAI's form), or taken as
    it is when it is already an object (Hugging Face chat templates' form, which ``LLM.chat`` accepts) or not
    valid JSON."""
    fn = call["function"]
    args = fn.get("arguments") or {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    return {"name": fn["name"], "arguments": args}


def tool_call_structural_tag(tools: list[dict[str, Any]], mode: str, parallel: bool) -> dict[str, Any]:
    """xgrammar structural tag for ``tools``: ``mode`` ``"forced"`` (only calls, at least one: ``required`` or a
    named function, the caller passing just that tool) or ``"auto"`` (text, and any call well formed);
    ``parallel`` False: at most one call."""
    tags = [{"type": "tag", "begin": f'{TOOL_CALL_START}\n{{"name": {json.dumps(t["function"]["name"])}, '
             '"arguments": ', "content": {"type": "json_schema", "json_schema": parameters_of(t)},
             "end": f"}}\n{TOOL_CALL_END}"} for t in tools]
    if mode == "forced":
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
               "stop_after_first": not parallel}
    else:
        fmt = {"type": "triggered_tags", "triggers": [TOOL_CALL_START], "tags": tags, "at_least_one": False,
               "stop_after_first": not parallel}
    return {"type": "structural_tag", "format": fmt}


@dataclass
class ToolCallDelta:
    """One piece of a tool call, in OpenAI's streaming shape: the first of a call has ``id`` and ``name``
    (``arguments`` ""), the next ones argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class _Call:
    index: int
    id: str
    name: str | None = None
    sent: str = ""  # argument text already sent


@dataclass
class ToolCallParser:
    """Splits a hermes-style output into content and tool calls, incrementally.

    :meth:`feed` takes the next text piece, :meth:`finish` the end; each returns ``(content, deltas)``: the new
    content text and the new :class:`ToolCallDelta`. A call's arguments stream as they arrive when the block has
    the canonical ``{"name": ..., "arguments": ...}`` order; otherwise the call comes whole at its
    ``</tool_call>``. A block that is not valid JSON (or lacks a name) stays content. Whitespace around calls is
    dropped. ``new_id()`` gives each call its id.
    """

    new_id: Any
    calls: list[_Call] = field(default_factory=list)
    _buf: str = ""  # text not yet released
    _in_call: bool = False
    _boundary: bool = True  # at the start or just after a call
    incomplete: bool = False  # the text ended inside a call already begun (cut by max_tokens or a stop)

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buf += text
        content, deltas = "", []
        while True:
            if not self._in_call:
                i = self._buf.find(TOOL_CALL_START)
                if i < 0:
                    keep = _partial_suffix(self._buf, TOOL_CALL_START)
                    safe = self._buf[:len(self._buf) - keep].rstrip()  # trailing whitespace: held
                    content += self._release(safe)
                    self._buf = self._buf[len(safe):]
                    return content, deltas
                content += self._release(self._buf[:i].rstrip())
                self._buf = self._buf[i + len(TOOL_CALL_START):]
                self._in_call = True
                self.calls.append(_Call(len(self.calls), self.new_id()))
            call = self.calls[-1]
            j = self._buf.find(TOOL_CALL_END)
            if j < 0:
                deltas += self._stream_args(call, self._buf)
                return content, deltas
            block, self._buf = self._buf[:j], self._buf[j + len(TOOL_CALL_END):]
            self._in_call = False
            done = self._close(call, block)
            if done is None:  # not a call: its text is content
                self.calls.pop()
                content += self._release(f"{TOOL_CALL_START}{block}{TOOL_CALL_END}")
            else:
                deltas += done
                self._boundary = True

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The end of the text: an unclosed block that parses whole is a call; one cut after its name was sent
        stays a call with the arguments generated so far (``incomplete``; as OpenAI reports a call cut by
        ``max_tokens``: the finish reason then says why); what else is left is content."""
        content, deltas = "", []
        if self._in_call:
            call = self.calls[-1]
            done = self._close(call, self._buf)
            if done is None and call.name is not None:
                self.incomplete = True
            elif done is None:
                self.calls.pop()
                content = self._release(f"{TOOL_CALL_START}{self._buf}".rstrip())
            else:
                deltas = done
        else:
            content = self._release(self._buf.rstrip())
        self._buf, self._in_call = "", False
        return content, deltas

    def _release(self, text: str) -> str:
        """Content text to send; its leading whitespace is dropped at the start and after a call."""
        if self._boundary:
            text = text.lstrip()
            self._boundary = not text
        return text

    def _stream_args(self, call: _Call, block: str) -> list[ToolCallDelta]:
        m = _CALL_PREFIX.match(block)
        if m is None:
            return []
        out = []
        if call.name is None:
            call.name = json.loads(f'"{m.group(1)}"')
            out.append(ToolCallDelta(call.index, call.id, call.name))
        rest = block[m.end():]
        tail = _CLOSE_TAIL.search(rest)
        safe = rest[:tail.start()] if tail else rest
        if len(safe) > len(call.sent) and safe.startswith(call.sent):
            out.append(ToolCallDelta(call.index, arguments=safe[len(call.sent):]))
            call.sent = safe
        return out

    def _close(self, call: _Call, block: str) -> list[ToolCallDelta] | None:
        """The deltas that complete ``call`` from its whole ``block``, or None if it is no call."""
        parsed = split_call(block)
        if parsed is None:
            return None
        name, args = parsed
        out = []
        if call.name is None:
            call.name = name
            out.append(ToolCallDelta(call.index, call.id, name))
        if call.name != name or not args.startswith(call.sent):  # cannot happen for a canonical block
            return None
        if len(args) > len(call.sent):
            out.append(ToolCallDelta(call.index, arguments=args[len(call.sent):]))
        call.sent = args
        return out


def split_call(block: str) -> tuple[str, str] | None:
    """``(name, arguments JSON text)`` of one ``<tool_call>`` block's JSON, or None if it is none. In the
    canonical order the arguments are the block's own text (so streamed pieces add up to it); else re-serialized;
    missing or null arguments are ``"{}"``."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if args is None:
        return obj["name"], "{}"
    m = _CALL_PREFIX.match(block)
    if m is not None:
        raw = block[m.end():].rstrip()
        if raw.endswith("}"):
            raw = raw[:-1].rstrip()
            try:
                if json.loads(raw) == args:
                    return obj["name"], raw
            except ValueError:
                pass
    return obj["name"], json.dumps(args, ensure_ascii=False)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0

"""Function calling (`tools`, `tool_choice`) through the model's own chat template, Hermes style.

The tools are rendered by the model's chat template (`apply_chat_template(..., tools=...)`), so a model sees them
the way it was trained to. Where the template renders tools and asks for calls as JSON between `<tool_call>` and
`</tool_call>` (the Hermes format of Qwen2.5 and many others; vLLM's `hermes` parser), the answer is parsed:
each well-formed `{"name": ..., "arguments": {...}}` block becomes a `tool_calls` entry (arguments as a JSON
string, as OpenAI sends them), the text around the blocks stays the content, and the finish reason becomes
`tool_calls`. A block that does not parse stays in the content, as it was generated. A template that ignores
`tools` (SmolLM2's) gets a 400 naming `tools`: its model could only guess at a format.

`tool_choice`: `auto` (the default) lets the model choose; `none` leaves the tools out of the prompt (the model
cannot call one); `required` or `{"type": "function", "function": {"name": ...}}` forces a call by constrained
decoding (`serve.logits`): the answer must be one `<tool_call>` block whose name is a given tool's (that one's)
and whose arguments match its `parameters` schema.

Messages going back to the model: an assistant message's `tool_calls` (its arguments parsed back into objects,
which is what templates render) and `role: tool` messages with their `tool_call_id`.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from kvmem.serve.schemas import fail

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE) + r"|$)", re.S)
_SUPPORT: dict[int, bool] = {}
_PROBE_TOOL = {"type": "function", "function": {"name": "kvmem_probe", "description": "d",
                                                 "parameters": {"type": "object", "properties": {}}}}


def template_renders_tools(tokenizer) -> bool:
    """Whether the chat template renders a tool and asks for Hermes-style `<tool_call>` blocks."""
    if id(tokenizer) not in _SUPPORT:
        ok = False
        if tokenizer.chat_template is not None:
            messages = [{"role": "user", "content": "hi"}]
            try:
                plain = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                tooled = tokenizer.apply_chat_template(messages, tools=[_PROBE_TOOL], tokenize=False,
                                                       add_generation_prompt=True)
                ok = tooled != plain and "kvmem_probe" in tooled and OPEN in tooled
            except Exception:  # noqa: BLE001 - a template that fails with tools does not support them
                ok = False
        _SUPPORT[id(tokenizer)] = ok
    return _SUPPORT[id(tokenizer)]


def read_tools(tokenizer, extra: dict) -> tuple[list[dict] | None, Any]:
    """The request's `tools` checked (None when there are none or `tool_choice` is none) and its `tool_choice`."""
    tools, choice = extra.get("tools"), extra.get("tool_choice")
    if extra.get("functions") or extra.get("function_call"):
        fail(400, "functions/function_call are deprecated; send tools and tool_choice", param="functions")
    if not tools:
        if choice not in (None, "none", "auto"):
            fail(400, f"tool_choice={choice!r} needs tools", param="tool_choice")
        return None, None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) and t["function"]["name"] for t in tools):
        fail(400, 'tools must be a list of {"type": "function", "function": {"name": ..., "parameters": {...}}}',
             param="tools")
    names = [t["function"]["name"] for t in tools]
    for t in tools:
        if not isinstance(t["function"].get("parameters", {}), dict):
            fail(400, f"tools: the parameters of {t['function']['name']!r} must be a JSON schema object", param="tools")
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in names:
            fail(400, f"tool_choice names a function that is not in tools ({name!r})", param="tool_choice")
    elif choice not in ("none", "auto", "required"):
        fail(400, f"tool_choice must be none, auto, required or a function; got {choice!r}", param="tool_choice")
    if choice == "none":
        return None, choice
    if not template_renders_tools(tokenizer):
        fail(400, "this model's chat template does not render tools (no function calling); serve a model whose "
                  "template does, e.g. qwen2.5-coder-0.5b", param="tools")
    return tools, choice


def forced_call_grammar(tokenizer, tools: list[dict], choice) -> str | None:
    """An llguidance grammar for `tool_choice` required or named: one `<tool_call>` block, a listed name (the named
    one) and arguments matching its schema. None for `auto`."""
    import llguidance

    if choice == "auto":
        return None
    wanted = [t["function"] for t in tools if choice == "required" or t["function"]["name"] == choice["function"]["name"]]
    schema = {"anyOf": [{"type": "object", "properties": {
        "name": {"const": f["name"]}, "arguments": f.get("parameters") or {"type": "object"}},
        "required": ["name", "arguments"], "additionalProperties": False} for f in wanted]}
    ids = tokenizer.convert_tokens_to_ids([OPEN, CLOSE])
    # the tags are tokens of their own in the templates that use them (<[id]> in llguidance's lark), else text
    tag = [f"<[{i}]>" if i is not None and i != tokenizer.unk_token_id else json.dumps(t) for i, t in zip(ids, (OPEN, CLOSE))]
    return llguidance.LLMatcher.grammar_from_lark(
        f'start: {tag[0]} "\\n" call "\\n" {tag[1]}\ncall: %json ' + json.dumps(schema))


def template_message(role: str, content: str, extra: dict) -> dict:
    """A request message as the chat template takes it: with its tool calls (arguments as objects) or the id of the
    call it answers."""
    message: dict[str, Any] = {"role": role, "content": content}
    if extra.get("tool_calls"):
        calls = []
        for call in extra["tool_calls"]:
            f = call.get("function") if isinstance(call, dict) else None
            if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                fail(400, "an assistant message's tool_calls need function.name and function.arguments",
                     param="messages")
            arguments = f.get("arguments", "{}")
            try:
                arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
            except json.JSONDecodeError:
                fail(400, f"the arguments of tool call {f['name']!r} are not JSON", param="messages")
            calls.append({"id": call.get("id"), "type": "function", "function": {"name": f["name"],
                                                                                  "arguments": arguments}})
        message["tool_calls"] = calls
    for key in ("tool_call_id", "name"):
        if extra.get(key) is not None:
            message[key] = extra[key]
    if role == "tool" and not extra.get("tool_call_id"):
        fail(400, "a tool message needs the tool_call_id it answers", param="messages")
    return message


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """The content and the tool calls in a Hermes-style answer (see the module doc)."""
    calls, kept, last = [], [], 0
    for m in _BLOCK.finditer(text):
        try:
            call = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            continue
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": call["name"],
                                   "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}})
        kept.append(text[last:m.start()])
        last = m.end()
    if not calls:
        return text, []
    content = ("".join(kept) + text[last:]).strip()
    return content or None, calls


class ToolTextFilter:
    """Streaming with tools: content is sent as it comes until a `<tool_call>` may be starting; from there on the
    text is held, and parsed at the end (`finish`)."""

    def __init__(self):
        self.text, self.sent = "", 0

    def feed(self, delta: str) -> str:
        """The part of the text so far that is safe to send as content."""
        self.text += delta
        at = self.text.find(OPEN)
        if at < 0:  # hold back a possible start of the tag
            at = len(self.text) - max((k for k in range(min(len(OPEN) - 1, len(self.text)), 0, -1)
                                       if self.text.endswith(OPEN[:k])), default=0)
        out, self.sent = self.text[self.sent:max(at, self.sent)], max(at, self.sent)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """The content not sent yet, and the tool calls."""
        content, calls = parse_tool_calls(self.text[self.sent:])
        return content or "", calls

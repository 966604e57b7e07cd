"""Anthropic's Messages API: its request, its response objects, and the request as a chat completion.

`/v1/messages` is a translation onto the chat path (routes/messages.py): a Messages request becomes the
`ChatCompletionRequest` it means (`to_chat`), and that request renders, constrains and parses as any chat
does. What the translation does with each field:

- `system` (a string or text blocks, joined with blank lines) -> a system message.
- user `text` blocks -> the user message (joined with newlines); `image` blocks (`source` of type `base64`
  or `url`, the URL read only where the server's media policy allows) -> its `image_url` parts, in place
  (docs/multimodal.md §6); `tool_result` blocks -> tool messages, placed before the user message (the
  order the template expects); `is_error` results are sent to the model as `{"error": text}`; `document`
  blocks and images by `file_id` -> 400.
- assistant `thinking` blocks -> reasoning_content (the signature is accepted and not checked),
  `redacted_thinking` is dropped, `text` -> content, `tool_use` -> tool_calls. A last assistant message is a
  prefill (continue_final_message): the prompt ends inside that turn, after its text, and the reply continues
  it (its content holds only what follows); trailing whitespace there is a 400, as Anthropic answers.
- `tools[{name, description, input_schema, strict}]` -> function tools; server tools (any other `type`,
  such as `web_search_20250305` or `bash_20250124`) are dropped.
- `tool_choice` auto / any / tool / none -> auto / required / named / none (any and tool are grammars);
  `disable_parallel_tool_use` -> parallel_tool_calls false.
- `thinking` enabled or adaptive -> enable_thinking; disabled -> off; absent -> the server's default.
  `budget_tokens` is enforced (`budget_of`): the engine closes a thought that reaches it and the answer
  follows (`gem4.structured.spec.ThoughtBudget`).
- `output_config.format` json_schema -> response_format json_schema.
- `stop_sequences`, `temperature`, `top_p`, `top_k` (and the extensions `seed` and `logit_bias`) pass
  through; `max_tokens` is clamped to the free context by the handler. `metadata`, `cache_control`,
  `service_tier` and other fields are ignored.

Errors on these routes use Anthropic's envelope (`error_body`): the chat API's 503 is a 529
`overloaded_error`, which Anthropic's clients retry.
"""
from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gem4.server import protocol as P

SIGNATURE = "gem4"      # the signature of every thinking block: gem4 neither signs nor checks thoughts


class _In(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ToolDef(_In):
    name: str
    type: str | None = None                    # None or "custom": a client tool; anything else: a server tool
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoice(_In):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(_In):
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(None, ge=1)


class OutputFormat(_In):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_In):
    format: OutputFormat | None = None


class MessageIn(_In):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class CountTokensRequest(_In):
    model: str | None = None
    messages: list[MessageIn] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = None                    # extensions (vLLM's): reproducible sampling, token biases
    logit_bias: dict[str, float] | None = None


def _text(block: Any, where: str) -> str:
    """A text block's text; 400 naming `where` for any other block."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind == "text" and isinstance(block.get("text"), str):
        return block["text"]
    if kind in ("image", "document"):
        raise P.bad_request(f"{where}: {kind} input is not supported here (images go in user messages)",
                            f"{where}.type")
    raise P.bad_request(f"{where} must be a text block", where)


def _texts(blocks: str | list, where: str) -> str:
    """A string, or text blocks joined with newlines."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise P.bad_request(f"{where} must be a string or an array of text blocks", where)
    return "\n".join(_text(b, f"{where}[{i}]") for i, b in enumerate(blocks))


def _image(block: dict, where: str) -> dict:
    """An image block as a chat image_url part: base64 data as a data URI, a URL as it is."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("media_type"), str) and isinstance(source.get("data"), str):
        return {"type": "image_url", "image_url": {"url": f"data:{source['media_type']};base64,{source['data']}"}}
    if kind == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    refs = "'file' sources are not supported (this server has no Files API); " if kind == "file" else ""
    raise P.bad_request(f"{where}.source: {refs}an image needs a source of type 'base64' (media_type, data) or "
                        f"'url' (url)", f"{where}.source")


Origin = tuple[str, list[int] | None]    # a chat message's content came from: a field, and its blocks' indices


def _user(content: str | list, where: str) -> list[tuple[dict, Origin]]:
    """A user message's blocks -> its tool messages, then the user message of its text and images (if any),
    each with where its content came from (`client_param`)."""
    if isinstance(content, str):
        return [({"role": "user", "content": content}, (where, None))]
    tools, parts, kept = [], [], []
    for i, b in enumerate(content):
        kind = b.get("type")
        if kind == "tool_result":
            if not isinstance(b.get("tool_use_id"), str):
                raise P.bad_request(f"{where}[{i}].tool_use_id must be a string", f"{where}[{i}].tool_use_id")
            text = _texts(b.get("content") or "", f"{where}[{i}].content")
            if b.get("is_error"):
                text = json.dumps({"error": text})
            tools.append(({"role": "tool", "tool_call_id": b["tool_use_id"], "content": text},
                          (f"{where}[{i}].content", None)))
            continue
        if kind == "image":
            parts.append(_image(b, f"{where}[{i}]"))
        else:                           # texts joined with newlines, as a string of them would be
            text = _text(b, f"{where}[{i}]")
            parts.append({"type": "text", "text": "\n" + text if parts and parts[-1]["type"] == "text" else text})
        kept.append(i)
    if not parts:
        return tools
    if all(p["type"] == "text" for p in parts):
        return [*tools, ({"role": "user", "content": "".join(p["text"] for p in parts)}, (where, None))]
    return [*tools, ({"role": "user", "content": parts}, (where, kept))]


def _assistant(content: str | list, where: str) -> dict:
    """An assistant message's blocks -> one chat assistant message (content, reasoning, tool calls)."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    msg: dict[str, Any] = {"role": "assistant", "content": None}
    texts, thoughts, calls = [], [], []
    for i, b in enumerate(content):
        kind = b.get("type")
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind == "thinking" and isinstance(b.get("thinking"), str):
            thoughts.append(b["thinking"])
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use" and isinstance(b.get("name"), str) and isinstance(b.get("input", {}), dict):
            calls.append({"id": b.get("id"), "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}))}})
        else:
            raise P.bad_request(f"{where}[{i}]: an assistant block must be text, thinking, redacted_thinking or "
                                f"tool_use with its fields", f"{where}[{i}]")
    if texts:
        msg["content"] = "\n".join(texts)
    if thoughts:
        msg["reasoning_content"] = "\n".join(thoughts)
    if calls:
        msg["tool_calls"] = calls
    return msg


def thinking_of(req: CountTokensRequest) -> bool | None:
    """enable_thinking as the request asks: None when it does not say (the server's default)."""
    return None if req.thinking is None else req.thinking.type != "disabled"


def budget_of(req: CountTokensRequest) -> int | None:
    """The most thought tokens the request allows (thinking.budget_tokens), None: no bound."""
    return None if req.thinking is None or req.thinking.type == "disabled" else req.thinking.budget_tokens


def to_chat(req: CountTokensRequest) -> P.ChatCompletionRequest:
    """The chat completion request a Messages request means (see the module docstring); 400 naming the
    field for what the chat API refuses."""
    messages = [m for m, _ in _messages(req)]
    chat: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.messages[-1].role == "assistant":        # a prefill: the reply continues it
        last = f"messages[{len(req.messages) - 1}].content"
        text = messages[-1].get("content") or ""
        if text != text.rstrip():
            raise P.bad_request(f"{last}: the final assistant content cannot end with trailing whitespace", last)
        chat.update(add_generation_prompt=False, continue_final_message=True)
    tools = [t for t in req.tools or [] if t.type in (None, "custom")]
    if tools:
        chat["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description, "strict": t.strict,
            "parameters": t.input_schema if t.input_schema is not None else {"type": "object", "properties": {}}}}
            for t in tools]
    choice = req.tool_choice
    if choice is not None:
        if choice.type in ("any", "tool") and not tools:
            raise P.bad_request(f"tool_choice of type '{choice.type}' needs 'tools'", "tool_choice")
        if choice.type == "tool":
            if choice.name is None:
                raise P.bad_request("tool_choice of type 'tool' needs 'name'", "tool_choice.name")
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        chat["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if req.output_config is not None and req.output_config.format is not None:
        chat["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": req.output_config.format.schema_}}
    thinking = thinking_of(req)
    if thinking is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": thinking}
    if isinstance(req, MessagesRequest):
        chat.update(max_tokens=req.max_tokens, stream=req.stream, temperature=req.temperature, top_p=req.top_p,
                    top_k=req.top_k, seed=req.seed, logit_bias=req.logit_bias, stop=req.stop_sequences or None)
    try:
        return P.parse_request(P.ChatCompletionRequest, json.dumps(chat).encode())
    except P.APIError as e:
        raise client_error(req, e) from None


def _messages(req: CountTokensRequest) -> list[tuple[dict, Origin]]:
    """The chat messages of `system` and `messages`, each with where its content came from."""
    out: list[tuple[dict, Origin]] = []
    if req.system is not None:
        system = req.system if isinstance(req.system, str) else "\n\n".join(
            _text(b, f"system[{i}]") for i, b in enumerate(req.system))
        out.append(({"role": "system", "content": system}, ("system", None)))
    for i, m in enumerate(req.messages):
        where = f"messages[{i}].content"
        out += _user(m.content, where) if m.role == "user" else [(_assistant(m.content, where), (where, None))]
    return out


_CHAT_TOOL = re.compile(r"tools\[(\d+)\]\.function(.*)")
_CHAT_PART = re.compile(r"messages\[(\d+)\]\.content\[(\d+)\](.*)")


def client_param(req: CountTokensRequest, param: str) -> str:
    """A parameter of the chat request `req` became (`to_chat`) as the Messages field it came from:
    `tools[j].function.parameters` -> `tools[i].input_schema` (i: the tool's index among all of `req.tools`,
    server tools included), `tools[j].function.X` -> `tools[i].X`, `response_format.json_schema.schema` ->
    `output_config.format.schema`, `stop` -> `stop_sequences`, `messages[k].content[j]...` -> the block it
    came from (`messages[i].content[b]...`), other `messages[k]...` -> `messages` (chat messages do not map one
    to one onto Anthropic's)."""
    tool = _CHAT_TOOL.fullmatch(param)
    kept = [i for i, t in enumerate(req.tools or []) if t.type in (None, "custom")]
    if tool is not None and int(tool[1]) < len(kept):
        rest = tool[2]
        if rest.startswith(".parameters"):
            rest = ".input_schema" + rest.removeprefix(".parameters")
        return f"tools[{kept[int(tool[1])]}]{rest}"
    if param.startswith("response_format"):
        return "output_config.format" + param.removeprefix("response_format").removeprefix(".json_schema")
    part = _CHAT_PART.fullmatch(param)
    if part is not None:
        origins = [origin for _, origin in _messages(req)]
        k, j = int(part[1]), int(part[2])
        if k < len(origins) and origins[k][1] is not None and j < len(origins[k][1]):
            return f"{origins[k][0]}[{origins[k][1][j]}]{part[3]}"
    if param.startswith(("messages[", "messages.")):
        return "messages"
    return {"stop": "stop_sequences", "max_completion_tokens": "max_tokens"}.get(param, param)


def client_error(req: CountTokensRequest, e: P.APIError) -> P.APIError:
    """An error of the chat path, naming the Messages field (`client_param`)."""
    return P.renamed(e, lambda param: client_param(req, param))


# ---------------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------------


class _Out(BaseModel):
    """A response object: every field on the wire, None as null (as Anthropic sends them)."""

    @model_validator(mode="after")
    def _every_field(self):
        self.model_fields_set.update(type(self).model_fields)
        return self


class MessagesUsage(_Out):
    """Anthropic's usage: the prompt tokens computed (`input_tokens`) and read from the prefix cache
    (`cache_read_input_tokens`) add up to the prompt; nothing is written to a cache on request."""

    input_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0
    output_tokens: int = 0


class Message(_Out):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: MessagesUsage


STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def stop_reason(finish_reason: str | None, stop_sequence: str | None) -> str:
    """The chat finish_reason as Anthropic's stop_reason (a matched stop string: stop_sequence)."""
    if stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(finish_reason or "stop", "end_turn")


# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors); the chat API's 503s
# (busy, loading, shutting down) are 529 here: Anthropic's clients retry an overloaded_error.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               529: "overloaded_error"}


def error_status(status: int) -> int:
    return 529 if status == 503 else status


def error_body(status: int, message: str) -> dict:
    """Anthropic's error envelope for an error of HTTP `status` (after `error_status`)."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error" if status >= 500
                                                               else "invalid_request_error"), "message": message}}

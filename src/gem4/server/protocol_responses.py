"""The OpenAI Responses wire format (`POST /v1/responses`): the request model, and its translation onto a
chat request (`chat_body`), so that the chat path renders, constrains, parses and streams it.

A request carries its whole conversation in `input` (Codex CLI sends the full history every turn, with
`store: false`), or continues a stored response's (`previous_response_id`, server/store.py: a bounded
in-memory store, `--responses-store-mb`); `conversation`, `background: true` and `item_reference` items are
refused with a 400 naming them, as is `previous_response_id` on a server without a store.

Input items -> chat messages:

- a string is one user message; `instructions` is a system message before it;
- `message` items (user, system, developer, assistant; content a string or input_text / output_text /
  refusal parts) are messages; a user message's `input_image` parts (`image_url`: a data URI, or a URL the
  server's media policy allows; `detail` is ignored, the request's `mm_processor_kwargs.max_soft_tokens` sets
  the budget) and `input_audio` parts (`{data, format}`) are chat `image_url` / `input_audio` parts
  (docs/multimodal.md §6); `file_id` references and `input_file` parts are refused (no Files API);
- contiguous `reasoning`, assistant `message` and `function_call` / `custom_tool_call` items form ONE
  assistant message: its reasoning_content (the item's `content` texts, else its `summary`, else its
  `encrypted_content`, which is plain text when gem4 wrote it), its content, its tool_calls;
- `function_call_output` / `custom_tool_call_output` items are tool messages.

Tools: `function` tools are chat tools; a `custom` (freeform) tool is a function of `{"input": string}`, its
calls come back as `custom_tool_call` items; hosted tools (web search, file search, code interpreter, ...)
are dropped, as nothing here can run them; any other type is a 400 naming `tools[i].type`.
"""
from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from gem4.server import protocol as P
from gem4.server.protocol import bad_request

# tools the server would have to run itself: never shown to the model
HOSTED_TOOLS = frozenset({"web_search", "web_search_preview", "web_search_preview_2025_03_11", "file_search",
                          "code_interpreter", "image_generation", "mcp", "computer_use_preview", "local_shell"})
CUSTOM_PARAMETERS = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
THINKING_OFF = frozenset({"none", "minimal"})
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class ReasoningConfig(P._In):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None


class TextFormat(P._In):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(P._In):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(P.SamplingRequest):
    """The body of POST /v1/responses. Input items and tools stay plain objects here: `chat_body` checks
    them one by one, naming `input[i]...` / `tools[i]...` in its errors."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=P.MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = None
    store: bool = True                       # keep the response for previous_response_id (server/store.py)
    previous_response_id: str | None = None  # continue a stored response's conversation
    # state gem4 does not keep: refused (`check_stateless`)
    conversation: Any = None
    background: bool | None = None
    # accepted and ignored: metadata, user, safety_identifier, prompt_cache_key (prefix caching is automatic),
    # service_tier, truncation, client_metadata

    @property
    def thinking(self) -> bool | None:
        """enable_thinking as reasoning.effort asks it (none / minimal: off), None: the server's default."""
        if self.reasoning is None or self.reasoning.effort is None:
            return None
        return self.reasoning.effort not in THINKING_OFF

    @property
    def logprobs(self) -> bool:
        return self.top_logprobs is not None or LOGPROBS_INCLUDE in (self.include or [])


def _checked(model: type[BaseModel], value: dict, where: str, inner: str = "") -> None:
    """`value` validated as chat's `model`; a 400 naming the field under `where` (the Responses path), not
    under the chat request it becomes."""
    try:
        model.model_validate(value)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        sub = P.param_path(tuple(err.get("loc", ())))
        sub = (sub or "").removeprefix(inner).lstrip(".")
        param = f"{where}.{sub}" if sub else where
        raise bad_request(f"Invalid '{param}': {err.get('msg', 'invalid value').removeprefix('Value error, ')}",
                          param) from None


def check_stateless(req: ResponsesRequest, store: bool) -> None:
    """400 for the state this server does not keep: conversations, background responses, and stored responses
    when it has no response store (`store`: it has one)."""
    for name, value in (("previous_response_id", None if store else req.previous_response_id),
                        ("conversation", req.conversation), ("background", req.background or None)):
        if value is not None:
            kept = "conversations" if store else "responses or conversations (--responses-store-mb 0)"
            raise bad_request(f"'{name}' is not supported: this server keeps no {kept}. Send the whole "
                              f"conversation in 'input' instead.", name)


def input_items(req: ResponsesRequest) -> list[dict]:
    """`input` as items (a string is one user message)."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    return req.input


def _text(content: Any, where: str) -> str | list[dict]:
    """A message's or an output's content as chat content: a string, or its parts as chat parts, one for one
    (so that `content[j]` names the same part on both sides: `client_param`)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("content must be a string or an array of content parts", where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
        elif kind == "input_image":
            if not isinstance(part.get("image_url"), str):
                refs = "'file_id' references are not supported (this server has no Files API); " \
                    if part.get("file_id") is not None else ""
                raise bad_request(f"{refs}an input_image part needs 'image_url' (a data URI or URL)",
                                  f"{where}[{j}].image_url")
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        elif kind == "input_audio":
            parts.append({"type": "input_audio", "input_audio": part.get("input_audio")})
        elif kind == "input_file":
            raise bad_request("content parts of type 'input_file' are not supported (this server has no Files "
                              "API and reads no documents)", f"{where}[{j}].type")
        else:
            raise bad_request(f"unsupported content part type {kind!r}", f"{where}[{j}].type")
    return parts


def _reasoning_text(item: dict) -> str:
    for key in ("content", "summary"):
        texts = [p.get("text", "") for p in item.get(key) or [] if isinstance(p, dict)]
        if any(texts):
            return "".join(texts)
    encrypted = item.get("encrypted_content")
    return encrypted if isinstance(encrypted, str) else ""


def chat_messages(req: ResponsesRequest, history: list[dict] | tuple = ()) -> list[dict]:
    """`instructions`, then the `history` items (a stored response's conversation, for previous_response_id)
    and the `input` items, as chat messages (see the module docstring)."""
    return _translate(req, history)[0]


def _translate(req: ResponsesRequest, history: list[dict] | tuple) -> tuple[list[dict], list[str]]:
    """The chat messages (`chat_messages`), and for each the Responses field it came from: its content's
    (`input[i].content`, `input[i].output`) for a message whose content parts are the item's one for one,
    else the item's (`input[i]`, `instructions`, `previous_response_id`)."""
    messages: list[dict] = []
    origins: list[str] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
        origins.append("instructions")
    turn: dict | None = None              # the assistant message being assembled from contiguous items
    where = ""

    def assistant() -> dict:
        nonlocal turn
        if turn is None:
            turn = {"role": "assistant", "content": None}
            messages.append(turn)
            origins.append(where)
        return turn

    def inner(key: str) -> str:
        return f"{where}.{key}" if where.startswith("input") else where

    for i, item in enumerate([*history, *input_items(req)]):
        where = f"input[{i - len(history)}]" if i >= len(history) else "previous_response_id"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"unsupported message role {role!r}", f"{where}.role")
            content = _text(item.get("content"), f"{where}.content")
            if role == "assistant":
                t = assistant()
                if t.get("tool_calls") or t["content"] is not None:   # text after calls or text: a new turn
                    turn = None
                    t = assistant()
                t["content"] = content
            else:
                turn = None
                messages.append({"role": role, "content": content})
                origins.append(inner("content"))
        elif kind == "reasoning":
            t = assistant()
            if "reasoning_content" in t or t["content"] is not None or t.get("tool_calls"):
                turn = None                    # a second thought starts a new assistant turn
                t = assistant()
            t["reasoning_content"] = _reasoning_text(item)
        elif kind in ("function_call", "custom_tool_call"):
            if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
                raise bad_request(f"a {kind} item needs 'name' and 'call_id'", where)
            if kind == "function_call":
                arguments = item.get("arguments", "{}")
                _checked(P.FunctionCallIn, {"name": item["name"], "arguments": arguments}, where)
            else:
                arguments = json.dumps({"input": item.get("input", "")}, ensure_ascii=False)
            assistant().setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": arguments}})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"a {kind} item needs 'call_id'", f"{where}.call_id")
            turn = None
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item.get("output", ""), f"{where}.output")})
            origins.append(inner("output"))
        elif kind == "item_reference":
            raise bad_request("item_reference items are not supported: this server keeps no items (it is "
                              "stateless). Send the items themselves.", f"{where}.type")
        else:
            raise bad_request(f"unsupported input item type {kind!r}", f"{where}.type")
    return messages, origins


def chat_tools(req: ResponsesRequest) -> tuple[list[dict] | None, frozenset[str]]:
    """(the chat tools, the names of the custom ones): function and custom tools; hosted ones dropped."""
    if req.tools is None:
        return None, frozenset()
    tools, custom = [], set()
    for i, tool in enumerate(req.tools):
        kind = tool.get("type")
        if kind == "function":
            fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
            _checked(P.Tool, {"type": "function", "function": fn}, f"tools[{i}]", "function")
            tools.append({"type": "function", "function": fn})
        elif kind == "custom":
            if tool.get("format", {}).get("type", "text") != "text":
                raise bad_request("custom tools with a grammar format are not supported", f"tools[{i}].format")
            tools.append({"type": "function", "function": {
                "name": tool.get("name"), "description": tool.get("description"), "parameters": CUSTOM_PARAMETERS}})
            custom.add(tool.get("name"))
        elif kind not in HOSTED_TOOLS and not str(kind).startswith("web_search"):
            raise bad_request(f"unsupported tool type {kind!r}", f"tools[{i}].type")
    return tools, frozenset(custom)


def chat_tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") in ("function", "custom") and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(f"tool_choice of type {choice.get('type')!r} is not supported (use 'auto', 'none', "
                      f"'required' or a function by name)", "tool_choice")


def chat_response_format(text: TextConfig | None) -> dict | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None or fmt.name is None:
        raise bad_request("text.format of type 'json_schema' needs 'name' and 'schema'", "text.format")
    schema = {"name": fmt.name, "schema": fmt.schema_}
    schema.update({k: v for k, v in (("description", fmt.description), ("strict", fmt.strict)) if v is not None})
    return {"type": "json_schema", "json_schema": schema}


def chat_body(req: ResponsesRequest, history: list[dict] | tuple = ()) -> tuple[dict, frozenset[str]]:
    """The chat request equivalent to `req` (after the `history` items, for previous_response_id) but its token
    limit (clamped to the free context once the prompt is known), as a JSON object; and the names of the custom
    tools."""
    tools, custom = chat_tools(req)
    body = req.model_dump(include=set(P.SamplingRequest.model_fields) - {"max_tokens", "n", "stream", "stream_options"},
                          exclude_unset=True, by_alias=True)
    body.update(messages=chat_messages(req, history), parallel_tool_calls=req.parallel_tool_calls,
                logprobs=req.logprobs, top_logprobs=req.top_logprobs or 0)
    if tools:
        body["tools"] = tools
    if req.tool_choice is not None:
        body["tool_choice"] = chat_tool_choice(req.tool_choice)
    response_format = chat_response_format(req.text)
    if response_format is not None:
        body["response_format"] = response_format
    if req.thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking}
    return body, custom


_CHAT_TOOL = re.compile(r"tools\[(\d+)\]\.function(.*)")
_CHAT_MESSAGE = re.compile(r"messages\[(\d+)\](.*)")


def client_param(req: ResponsesRequest, param: str, history: list[dict] | tuple = ()) -> str:
    """A parameter of the chat request `req` became (`chat_body`, after `history`) as the Responses field it
    came from: `tools[j].function.X` -> `tools[i].X` (i: the tool's index among all of `req.tools`, hosted ones
    included; a custom tool's made-up parameters -> the tool), `response_format.json_schema.schema` ->
    `text.format.schema`, `messages[k].content[j]...` -> `input[i].content[j]...` (the message's item: see
    `_translate`; else `input`), the token limits -> `max_output_tokens`."""
    tool = _CHAT_TOOL.fullmatch(param)
    kept = [i for i, t in enumerate(req.tools or []) if t.get("type") in ("function", "custom")]
    if tool is not None and int(tool[1]) < len(kept):
        i, rest = kept[int(tool[1])], tool[2]
        if req.tools[i].get("type") == "custom" and rest.startswith(".parameters"):
            rest = ""
        return f"tools[{i}]{rest}"
    if param.startswith("response_format"):
        return "text.format" + param.removeprefix("response_format").removeprefix(".json_schema")
    message = _CHAT_MESSAGE.fullmatch(param)
    if message is not None:
        origins = _translate(req, history)[1]
        k, rest = int(message[1]), message[2]
        if k >= len(origins):
            return "input"
        origin = origins[k]
        if origin.endswith((".content", ".output")) and rest.startswith(".content"):
            return origin + rest.removeprefix(".content")
        return origin
    if param == "messages" or param.startswith("messages."):
        return "input"
    if param in ("max_tokens", "max_completion_tokens"):
        return "max_output_tokens"
    return param


def client_error(req: ResponsesRequest, e: P.APIError, history: list[dict] | tuple = ()) -> P.APIError:
    """An error of the chat path, naming the Responses field (`client_param`)."""
    return P.renamed(e, lambda param: client_param(req, param, history))

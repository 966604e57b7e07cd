"""The OpenAI wire format: request and response models (pydantic v2), and OpenAI error objects.

Requests are validated from the raw body with `parse_request(Model, body)`: JSON mode, strict types
(`"10"` is not an integer, `1` is not a bool), unknown fields ignored. Every failure -- invalid JSON,
a wrong type, a value out of range, a missing field -- becomes an `APIError` with status 400 and an
OpenAI error object naming the parameter (`messages[1].role`, `max_tokens`), never FastAPI's 422.

Responses are built with the models below and serialised with `dump(model)` (`exclude_unset`): a
field is on the wire exactly when the code set it, so `"finish_reason": null` and `"usage": null`
appear where OpenAI sends them and `reasoning_content` appears only when there was reasoning.

Tools are bounded before anything renders them (`check_tools`, `FunctionDef`): at most `MAX_TOOLS`
(128, OpenAI's own limit), each at most `MAX_TOOL_BYTES` (64 KiB as compact JSON; coding agents send
20-60 tools of a few KiB), JSON nested at most `MAX_JSON_DEPTH` (64) deep in a parameters schema or
in tool-call arguments (OpenAI's structured outputs allow 10 schema levels, about 22 JSON levels;
the templates format schemas and arguments recursively). The numbers are the grammar compiler's own
bounds on one schema (`gem4.structured.grammars`), which also bounds `response_format` and
`structured_outputs` schemas when it builds their grammar.

Extensions beyond OpenAI's parameters follow vLLM's names: `top_k`, `min_p`,
`repetition_penalty`, `stop_token_ids`, `ignore_eos`, `chat_template_kwargs`, `structured_outputs`
(`json`, `regex`, `choice`, `grammar`, `json_object`: docs/structured.md), and the `/tokenize` /
`/detokenize` bodies.
"""
from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    field_validator,
    model_validator,
)

from gem4.sampling import LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS
from gem4.stops import check_stops
from gem4.structured.grammars import MAX_NESTING, MAX_SPEC_BYTES

# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


class APIError(Exception):
    """An error the client gets as an OpenAI error object:
    `{"error": {"message", "type", "param", "code"}}` with this HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def renamed(e: APIError, rename: Callable[[str], str]) -> APIError:
    """`e` naming the field a client of another API sent (the Responses and Messages endpoints translate their
    requests into chat requests, whose errors name chat fields): its `param` through `rename`, and the message
    where it quotes the param (a path such as `tools[0].function.parameters` wherever it appears, a bare name
    such as `stop` only between quotes)."""
    if e.param is None:
        return e
    new = rename(e.param)
    if new == e.param:
        return e
    if re.search(r"[.\[]", e.param):
        message = re.sub(r"(?<![\w.\]])" + re.escape(e.param) + r"(?!\w)", new, e.message)
    else:
        message = e.message.replace(f"'{e.param}'", f"'{new}'")
    return APIError(e.status, message, type=e.type, param=new, code=e.code, headers=e.headers)


_ROLES = {"system", "developer", "user", "assistant", "tool"}


def _is_union_label(part, prev) -> bool:
    """pydantic puts the union member into an error's loc: a role tag after `messages[i]`, or a
    type label such as `str`, `list[str]`, `literal['none','auto']`, `NamedToolChoice`."""
    if not isinstance(part, str):
        return False
    if isinstance(prev, int) and part in _ROLES:
        return True
    return (part in ("str", "int", "float", "bool", "none") or any(c in part for c in "[(',")
            or part[:1].isupper())


def param_path(loc: tuple) -> str | None:
    """('messages', 0, 'user', 'content') -> 'messages[0].content'."""
    out = ""
    prev = None
    for part in loc:
        skip = _is_union_label(part, prev)
        prev = part
        if skip:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or None


def validation_error(e: ValidationError) -> APIError:
    """The first pydantic error as a 400 OpenAI error object."""
    err = e.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return bad_request(f"We could not parse the JSON body of your request: {err.get('msg')}. "
                           "The body must be a JSON object.")
    loc = tuple(err.get("loc", ()))
    param = param_path(loc)
    msg = err.get("msg", "invalid value")
    if err["type"] == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param)
    if err["type"] in ("model_type", "model_attributes_type", "dict_type") and not loc:
        return bad_request("The request body must be a JSON object.")
    msg = msg.removeprefix("Value error, ")
    if err["type"] == "union_tag_invalid":       # an unknown message role
        param = f"{param}.role" if param else "role"
    return bad_request(f"Invalid '{param}': {msg}" if param else msg, param)


def parse_request(model: type[BaseModel], body: bytes):
    """Validate a raw JSON body against a request model; raises APIError(400)."""
    if not body.strip():
        raise bad_request("The request body is empty; it must be a JSON object.")
    try:
        return model.model_validate_json(body, strict=True)
    except ValidationError as e:
        raise validation_error(e) from None


def dump(model: BaseModel) -> dict:
    """A response model as a JSON-ready dict: the fields that were set, nested models likewise."""
    return model.model_dump(exclude_unset=True)


def dump_json(model: BaseModel) -> str:
    return model.model_dump_json(exclude_unset=True)


# ---------------------------------------------------------------------------------------------
# Chat requests
# ---------------------------------------------------------------------------------------------


class _In(BaseModel):
    model_config = ConfigDict(extra="ignore")


_UNSUPPORTED_PARTS = {
    "input_image": "image",
    "image": "image",
    "input_audio": "audio",
    "audio": "audio",
    "audio_url": "audio",
    "video": "video",
    "file": "file",
}


def check_content(content: Any, *, allow_none: bool = False, media: bool = False) -> Any:
    """Message content: a string or a list of text parts `{"type": "text", "text": str}` -- and with `media`
    (user messages), image parts `{"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}}`, kept
    as `{"type": "image", "url": str}`, and audio parts `{"type": "input_audio", "input_audio": {"data": base64,
    "format": "wav"}}` (OpenAI's), kept as `{"type": "audio", "data": str, "format": str}`, and video parts
    `{"type": "video_url", "video_url": {"url": "data:video/...;base64,..."}}` (vLLM's) or `{"type": "input_video",
    "input_video": {"data": base64}}` (llama-server's), kept as `{"type": "video", "url": str}` (a data URI for
    input_video); all read and decoded later (server/inputs.py `chat_media`, server/media_fetch.py).
    (Failures are ValueErrors, wrong types included: pydantic turns only those into errors.)"""
    if content is None:
        if allow_none:
            return None
        raise ValueError("content is required")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"expected a string or an array of content parts, got {type(content).__name__}")  # noqa: TRY004
    parts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise ValueError(f"content part {i} must be an object with a 'type'")  # noqa: TRY004
        kind = part["type"]
        if kind in ("text", "input_text", "refusal"):
            text = part.get("text" if kind != "refusal" else "refusal")
            if not isinstance(text, str):
                raise ValueError(f"content part {i} of type '{kind}' needs a string 'text'")
            parts.append({"type": "text", "text": text})
        elif kind == "image_url" and media:
            parts.append({"type": "image", "url": _image_url(part.get("image_url"), i)})
        elif kind == "input_audio" and media:
            parts.append({"type": "audio", **_input_audio(part.get("input_audio"), i)})
        elif kind == "video_url" and media:
            parts.append({"type": "video", "url": _data_url(part.get("video_url"), i, "video")})
        elif kind == "input_video" and media:
            parts.append({"type": "video", "url": "data:video/*;base64," + _input_video(part.get("input_video"), i)})
        elif kind in ("image_url", "input_audio", "video_url", "input_video"):
            what = {"image_url": "images", "input_audio": "audio", "video_url": "videos", "input_video": "videos"}[kind]
            raise ValueError(f"content part {i}: {what} are accepted in user messages only")
        elif kind in _UNSUPPORTED_PARTS:
            raise ValueError(f"content part {i}: {_UNSUPPORTED_PARTS[kind]} input of type '{kind}' is not supported "
                             "(images come as 'image_url' parts, audio as 'input_audio' parts, videos as "
                             "'video_url' or 'input_video' parts, in user messages)")
        else:
            raise ValueError(f"content part {i} has unknown type '{kind}'")
    return parts


def _image_url(value: Any, i: int) -> str:
    """An image_url part's URL ({"url": ...} or the string itself): a base64 data URI of an image, or an http(s)
    or file:// URL, which the server reads only where its operator allows it (server/media_fetch.py)."""
    return _data_url(value, i, "image")


def _data_url(value: Any, i: int, kind: str) -> str:
    """An image_url or video_url part's URL ({"url": ...} or the string itself): a base64 data URI of that kind
    (vLLM's `video_url` shape is the image one's), or an http:, https: or file: URL (whether this server reads it
    is decided later, by its media policy: server/media_fetch.py)."""
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise ValueError(f"content part {i} of type '{kind}_url' needs '{kind}_url': {{'url': string}}")
    scheme = url.partition(":")[0].lower()
    if scheme in ("http", "https", "file"):
        return url
    head, _, data = url.partition(",")
    if not (head.startswith(f"data:{kind}/") and head.endswith(";base64") and data):
        raise ValueError(f"content part {i}: '{kind}_url' takes base64 data URIs of {kind}s "
                         f"(data:{kind}/...;base64,...) and http(s) or file URLs")
    return url


def _input_video(value: Any, i: int) -> str:
    """llama-server's input_video part: {"data": base64} (the bytes decide the format, as for audio)."""
    if not (isinstance(value, dict) and isinstance(value.get("data"), str) and value["data"]):
        raise ValueError(f"content part {i} of type 'input_video' needs 'input_video': {{'data': base64 string}}")
    return value["data"]


def _input_audio(value: Any, i: int) -> dict:
    """An input_audio part's {"data": base64, "format": str}. The format is the client's word only: the decoder
    reads what the bytes are (media/audio.py), so any format it reads is taken, whatever the part says."""
    if not (isinstance(value, dict) and isinstance(value.get("data"), str) and value["data"]
            and isinstance(value.get("format"), str)):
        raise ValueError(f"content part {i} of type 'input_audio' needs 'input_audio': "
                         f"{{'data': base64 string, 'format': string}}")
    return {"data": value["data"], "format": value["format"]}


Content = Annotated[Any, AfterValidator(check_content)]
UserContent = Annotated[Any, AfterValidator(lambda v: check_content(v, media=True))]
OptionalContent = Annotated[Any, AfterValidator(lambda v: check_content(v, allow_none=True))]


def content_text(content: Any) -> str:
    """A checked content value as one string (text parts joined with newlines; images and audio left out)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(p["text"] for p in content if p["type"] == "text")


MAX_TOOLS = 128                 # OpenAI's limit on functions per request
MAX_TOOL_BYTES = MAX_SPEC_BYTES  # one tool as compact JSON: what the grammar compiler takes of one schema
MAX_JSON_DEPTH = MAX_NESTING     # objects and arrays nested in a parameters schema or in tool-call arguments


def json_depth(value: Any) -> int:
    """How deeply objects and arrays nest in a JSON value (a scalar: 0), without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, depth = todo.pop()
        items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if items is None:
            continue
        deepest = max(deepest, depth)
        todo.extend((x, depth + 1) for x in items)
    return deepest


def check_depth(value: Any, where: str) -> None:
    depth = json_depth(value)
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"objects and arrays nested {depth} deep in {where}; at most {MAX_JSON_DEPTH} levels "
                         f"are accepted")


class FunctionCallIn(_In):
    name: str
    arguments: str | dict[str, Any] = "{}"

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, v):
        parsed = v
        if isinstance(v, str):
            try:
                parsed = json.loads(v) if v.strip() else {}
            except ValueError:
                raise ValueError("arguments must be a JSON object encoded as a string") from None
            except RecursionError:
                raise ValueError(f"the arguments nest objects and arrays more than {MAX_JSON_DEPTH} deep") from None
            if not isinstance(parsed, dict):
                raise ValueError("arguments must encode a JSON object")  # noqa: TRY004
        check_depth(parsed, "the arguments")
        return v


class ToolCallIn(_In):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class SystemMessage(_In):
    role: Literal["system", "developer"]
    content: Content
    name: str | None = None


class UserMessage(_In):
    role: Literal["user"]
    content: UserContent
    name: str | None = None


class AssistantMessage(_In):
    role: Literal["assistant"]
    content: OptionalContent = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class ToolMessage(_In):
    role: Literal["tool"]
    content: Content
    tool_call_id: str
    name: str | None = None


Message = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]

_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


class FunctionDef(_In):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _FUNCTION_NAME.match(v):
            raise ValueError(f"function name {v!r} must be 1-64 characters of a-z, A-Z, 0-9, '_', '.' or '-'")
        return v

    @field_validator("parameters")
    @classmethod
    def _schema(cls, v):
        if v is None:
            return v
        kind = v.get("type", "object")
        if kind != "object":
            raise ValueError(f"the parameters schema must be a JSON Schema of type \"object\", got type {kind!r}")
        props = v.get("properties", {})
        if not isinstance(props, dict) or not all(isinstance(p, dict) for p in props.values()):
            raise ValueError("'properties' must map each parameter name to a schema object")
        req = v.get("required", [])
        if not isinstance(req, list) or not all(isinstance(r, str) for r in req):
            raise ValueError("'required' must be an array of parameter names")
        check_depth(v, "the parameters schema")
        return v


class Tool(_In):
    type: Literal["function"]
    function: FunctionDef

    @model_validator(mode="after")
    def _size(self):
        size = len(self.model_dump_json(exclude_none=True))
        if size > MAX_TOOL_BYTES:
            raise ValueError(f"a tool may take at most {MAX_TOOL_BYTES} bytes as JSON, this one takes {size}")
        return self


def check_tools(v: list[Tool] | None) -> list[Tool] | None:
    if v is not None and len(v) > MAX_TOOLS:
        raise ValueError(f"at most {MAX_TOOLS} tools are accepted, got {len(v)}")
    return v


Tools = Annotated[list[Tool] | None, AfterValidator(check_tools)]


class NamedFunction(_In):
    name: str


class NamedToolChoice(_In):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_In):
    include_usage: bool = False


class JsonSchemaFormat(_In):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_In):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type 'json_schema' needs 'json_schema': {name, schema}")
        return self

    def wire(self) -> dict:
        """As the grammar builders take it (gem4.structured.grammars)."""
        return self.model_dump(by_alias=True, exclude_none=True)


class StructuredOutputs(_In):
    """vLLM's `structured_outputs` extension: exactly one of these constrains the output."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def wire(self) -> dict:
        return self.model_dump(by_alias=True, exclude_none=True)


_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")


class SamplingRequest(_In):
    """The sampling fields chat and completions share (OpenAI, then vLLM extensions)."""

    model: str | None = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1)                     # at most the engine's max_num_seqs (checked at submit)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    user: str | None = None
    # extensions (vLLM's names)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    structured_outputs: StructuredOutputs | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        """Non-empty strings, within the limits of gem4/stops.py (chat applies them in the server, so the
        engine's SamplingParams never sees them: they are checked here for both endpoints)."""
        stops = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        check_stops(stops)
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        """Keys are token ids written in ASCII digits, at most 10 of them (ids < 2^31): not
        `str.isdigit`, which also takes '²' (int() refuses it) and '٣' (int() reads it as 3)."""
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries, got {len(v)}")
        for k, b in v.items():
            if not _TOKEN_ID_KEY.fullmatch(k):
                shown = k if len(k) <= 20 else k[:20] + "..."
                raise ValueError(f"Invalid key {shown!r}: keys are token ids, non-negative integers written "
                                 f"in ASCII digits (at most 10)")
            if not -LOGIT_BIAS_RANGE <= b <= LOGIT_BIAS_RANGE:
                raise ValueError(f"values must be in [-100, 100], got {b}")
        return v

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def check_continue(messages: list[Message], add_generation_prompt: bool, continue_final_message: bool) -> None:
    """vLLM's rules for continue_final_message: not with a generation prompt, and an assistant message last."""
    if not continue_final_message:
        return
    if add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    if messages and messages[-1].role != "assistant":
        raise ValueError("continue_final_message needs an assistant message last")


class ChatCompletionRequest(SamplingRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: Tools = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    mm_processor_kwargs: dict[str, Any] | None = None     # vLLM's: {"max_soft_tokens": N}, an image's token budget
    continue_final_message: bool = False     # vLLM's: continue the last (assistant) message, a prefill

    @model_validator(mode="after")
    def _continue(self):
        check_continue(self.messages, self.add_generation_prompt, self.continue_final_message)
        return self

    @property
    def token_limit(self) -> int | None:
        """max_completion_tokens wins over the deprecated max_tokens."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---------------------------------------------------------------------------------------------
# Completions, tokenize, detokenize requests
# ---------------------------------------------------------------------------------------------


def _check_prompt(v):
    """A string, a token-id array, or a one-element array of either (one prompt per request)."""
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]
    if isinstance(v, str):
        if not v:
            raise ValueError("the prompt is empty")
        return v
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return v
    if isinstance(v, list) and len(v) > 1 and all(isinstance(p, (str, list)) for p in v):
        raise ValueError("only one prompt per request is supported")
    raise ValueError("prompt must be a non-empty string or an array of token ids")


class CompletionRequest(SamplingRequest):
    prompt: Annotated[Any, AfterValidator(_check_prompt)]
    # OpenAI's and vLLM's default for this endpoint; an explicit null generates until the context is full
    # (as in vLLM). Chat has no default: it generates until the context is full.
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v):
        if v:
            raise ValueError("suffix is not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v):
        if v not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return v


class TokenizeRequest(_In):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Tools = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False
    mm_processor_kwargs: dict[str, Any] | None = None     # as in chat: the images' token budget

    @model_validator(mode="after")
    def _one(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        check_continue(self.messages or [], self.add_generation_prompt, self.continue_final_message)
        return self


class DetokenizeRequest(_In):
    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------------


class _Out(BaseModel):
    """A response object. On the wire: every field with a non-None default, the fields named in
    `_always` (OpenAI sends them as null), and whatever the code set (see `dump`)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=False)
    _always: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="after")
    def _wire_fields(self):
        fields = type(self).model_fields
        self.model_fields_set.update(k for k, f in fields.items() if f.default is not None or k in self._always)
        return self


class PromptTokensDetails(_Out):
    cached_tokens: int = 0            # prompt tokens whose KV came from the prefix cache


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class FunctionCallOut(_Out):
    name: str | None = None
    arguments: str | None = None


class ToolCallOut(_Out):
    index: int | None = None          # streamed deltas only
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallOut


LOGPROB_FLOOR = -9999.0


def wire_logprob(x: float) -> float:
    """A logprob as the wire carries it: -inf (a token with no probability left), anything below
    -9999 and NaN are written as -9999.0, as vLLM writes them; JSON has no inf or NaN."""
    return x if x >= LOGPROB_FLOOR else LOGPROB_FLOOR       # NaN fails the comparison too


WireLogprob = Annotated[float, PlainSerializer(wire_logprob, return_type=float)]


class TopLogprob(_Out):
    token: str
    logprob: WireLogprob
    bytes: list[int] | None


class TokenLogprob(_Out):
    token: str
    logprob: WireLogprob
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(_Out):
    content: list[TokenLogprob] | None


class ChatMessage(_Out):
    _always = ("content",)

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(_Out):
    _always = ("logprobs", "finish_reason")

    index: int = 0
    message: ChatMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(_Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(_Out):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChunkChoice(_Out):
    _always = ("logprobs", "finish_reason")

    index: int = 0
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Out):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(_Out):
    tokens: list[str]
    token_logprobs: list[WireLogprob | None]
    top_logprobs: list[dict[str, WireLogprob] | None]
    text_offset: list[int]


class CompletionChoice(_Out):
    _always = ("logprobs", "finish_reason")

    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(_Out):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "gem4"
    root: str | None = None
    max_model_len: int


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]

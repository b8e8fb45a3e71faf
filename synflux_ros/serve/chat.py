"""OpenAI's chat completions API over the VLM runtime: a request body in, a :class:`ChatRequest` carrying the
whole conversation out (the runtime continues the session that holds it, or rebuilds it), and the reply as
OpenAI shapes it (``chat.completion``, or ``chat.completion.chunk`` events when streamed).

Images come as ``image_url`` parts holding ``data:`` URLs (PNG or JPEG, base64); the server fetches nothing.
Parameters that would change the reply and are not implemented (``stop``, ``n`` > 1, penalties, tools,
``logprobs``, response formats) are refused by name rather than ignored.
"""
from __future__ import annotations

import base64
import binascii
import math
import time
import uuid

from ..model.image import ImageError, decode_compressed
from ..runtimes.sessions import PastMessage
from ..runtimes.vlm import ChatRequest, ChatResult

SYSTEM_ROLES = ("system", "developer")
# Accepted and without effect here (they change nothing of the reply).
IGNORED = {"model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature",
           "top_p", "n", "user", "seed", "store", "metadata", "service_tier", "parallel_tool_calls"}
# Refused unless neutral: (parameter, its neutral value).
NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "logprobs": False, "stop": None, "tools": None,
           "tool_choice": None, "response_format": None, "logit_bias": None, "top_logprobs": None,
           "functions": None, "function_call": None, "modalities": None, "audio": None, "prediction": None}


def printable(text):
    """``text`` with anything UTF-8 cannot hold (lone surrogates from a client's JSON escapes) as escapes."""
    if text is None:
        return None
    return str(text).encode("utf-8", "backslashreplace").decode("utf-8")


class APIError(ValueError):
    """A request refused; ``status`` is the HTTP status, ``param`` the offending parameter."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 kind: str = "invalid_request_error"):
        # what the client sent is echoed: a lone surrogate in it could not be encoded as the body's UTF-8
        super().__init__(printable(message))
        self.status, self.param, self.code, self.kind = status, printable(param), code, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


def _image(url, where: str, max_pixels: int):
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str) or not url.startswith("data:"):
        raise APIError(f"{where}: only data: URLs are taken (data:image/png;base64,...); the server fetches "
                       f"nothing", param=where)
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise APIError(f"{where}: expected a base64 data: URL (data:image/<png|jpeg>;base64,...)", param=where)
    mime = header[len("data:"):-len(";base64")]
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(f"{where}: the data: URL is not valid base64", param=where) from None
    try:
        return decode_compressed(mime or "image", data, max_pixels=max_pixels)
    except ImageError as exc:
        raise APIError(f"{where}: {exc}", param=where) from None


def _content(msg: dict, i: int, max_pixels: int) -> tuple[str, list]:
    """A message's text and images (user messages may hold images)."""
    content = msg.get("content")
    where = f"messages[{i}].content"
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise APIError(f"{where}: expected a string or a list of parts, got {type(content).__name__}", param=where)
    texts, images = [], []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "image_url" and msg.get("role") == "user":
            images.append(_image(part.get("image_url"), f"{where}[{j}].image_url", max_pixels))
        else:
            allowed = "a text or an image_url part" if msg.get("role") == "user" else "a text part"
            raise APIError(f"{where}[{j}]: expected {allowed}, got {kind or type(part).__name__}",
                           param=f"{where}[{j}]")
    return "\n".join(texts), images


# Numbers beyond these are refused by name before any conversion (a JSON integer of 400 digits does not fit a
# float); the runtime then checks each against its own range.
MAX_INT_PARAM = 2**31 - 1
MAX_FLOAT_PARAM = 1e6


def _number(body: dict, name: str, kind, default=None):
    value = body.get(name, default)
    if value is None:
        return None
    what = "an integer" if kind is int else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise APIError(f"{name}: expected {what}, got {type(value).__name__}", param=name)
    if isinstance(value, int):
        if abs(value) > (MAX_INT_PARAM if kind is int else MAX_FLOAT_PARAM):
            raise APIError(f"{name}: {_short(value)} is out of range", param=name)
    elif not math.isfinite(value) or (kind is int and not value.is_integer()):
        raise APIError(f"{name}: expected {what}, got {value!r}", param=name)
    elif abs(value) > (MAX_INT_PARAM if kind is int else MAX_FLOAT_PARAM):
        raise APIError(f"{name}: {value!r} is out of range", param=name)
    return kind(value)


def _short(value: int) -> str:
    text = str(value) if value.bit_length() < 200 else None
    return text if text is not None else f"an integer of {value.bit_length()} bits"


def parse(body, session_id: str, model: str, max_pixels: int) -> tuple[ChatRequest, bool, bool]:
    """(the runtime's request, whether to stream, whether the stream ends with the usage)."""
    if not isinstance(body, dict):
        raise APIError("expected a JSON object")
    for name, neutral in NEUTRAL.items():
        if name in body and body[name] not in (neutral, None):
            raise APIError(f"{name}: not supported by this server (send it unset)", param=name)
    unknown = sorted(set(body) - IGNORED - set(NEUTRAL))
    if unknown:
        raise APIError(f"{unknown[0]}: unknown parameter", param=unknown[0])
    if body.get("model") not in (None, model):
        raise APIError(f"the model {body.get('model')!r} does not exist here; this server serves {model!r}",
                       param="model", status=404, code="model_not_found")
    n = _number(body, "n", int, 1)
    if n != 1:
        raise APIError(f"n: {n} choices asked for; this server gives one", param="n")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("messages: expected a non-empty list", param="messages")
    system, convo = None, []
    for i, msg in enumerate(messages):
        role = msg.get("role") if isinstance(msg, dict) else None
        if role in SYSTEM_ROLES:
            if convo or system is not None:
                raise APIError(f"messages[{i}]: a system message is taken only as the first message",
                               param=f"messages[{i}]")
            system = _content(msg, i, max_pixels)[0]
        elif role in ("user", "assistant"):
            text, images = _content(msg, i, max_pixels)
            convo.append(PastMessage(role, text, tuple(images)))
        else:
            raise APIError(f"messages[{i}].role: {role!r} is not taken (system, user, assistant)",
                           param=f"messages[{i}].role")
    last = convo.pop() if convo else None
    if last is None or last.role != "user":
        raise APIError("messages: the last message must be the user's", param="messages")
    max_tokens = _number(body, "max_completion_tokens", int)
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", int)
    temperature = _number(body, "temperature", float)
    if temperature is not None and not 0.0 <= temperature <= 2.0:
        raise APIError(f"temperature: {temperature} is out of range (0 to 2)", param="temperature")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError("stream: expected true or false", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError("stream_options: expected an object", param="stream_options")
    req = ChatRequest(session_id, last.text, list(last.images), max_new_tokens=max_tokens, temperature=temperature,
                      top_p=_number(body, "top_p", float), system=system, history=tuple(convo))
    return req, stream, bool(options.get("include_usage", False))


def usage(result: ChatResult) -> dict:
    prompt = result.prompt_tokens + result.cached_tokens
    return {"prompt_tokens": prompt, "completion_tokens": result.generated_tokens,
            "total_tokens": prompt + result.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}


def server_timing(result: ChatResult) -> dict:
    """The turn's times on the server (not OpenAI's: a field of ours, which clients ignore), from which a node
    using the endpoint tells the network's share of a turn."""
    return {"ttft_ms": round(result.ttft_ms, 3), "total_ms": round(result.total_ms, 3)}


def finish_reason(result: ChatResult) -> str:
    return "stop" if result.stopped_by_eos else "length"


def completion(result: ChatResult, model: str) -> dict:
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": {"role": "assistant", "content": result.reply},
                                         "finish_reason": finish_reason(result)}],
            "usage": usage(result), "server_timing": server_timing(result)}


class Chunks:
    """The ``chat.completion.chunk`` events of one streamed reply; :meth:`text` turns the token ids so far
    into the next content delta (held back while the text ends in an incomplete character)."""

    def __init__(self, model: str, decode, eos_ids):
        self.model, self.decode, self.eos = model, decode, set(eos_ids)
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        self.tokens: list[int] = []
        self.sent = ""

    def event(self, delta: dict, finish: str | None = None, **extra) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}

    def text(self, token: int) -> str:
        if token in self.eos:
            return ""
        self.tokens.append(token)
        text = self.decode(self.tokens)
        if text.endswith("\ufffd") or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta

    def rest(self, reply: str) -> str:
        """What of the final reply has not been sent (all of it sent so far is its beginning)."""
        return reply[len(self.sent):] if reply.startswith(self.sent) else ""

"""A checkpoint's chat template, rendered the way transformers' ``apply_chat_template`` renders it.

Where the template comes from, first found wins:

1. ``tokenizer.chat_template`` in the config (a ``.jinja`` file);
2. beside the tokenizer (the graph set ships the checkpoint's files): ``chat_template.jinja``,
   ``chat_template.json`` (``{"chat_template": ...}``, multimodal processors), ``tokenizer_config.json``'s
   ``chat_template`` (a string, or a list of named templates: ``default``);
3. a text-only model whose tokenizer.json has no template beside it is a base model:
   :class:`PlainCompletion` serves the conversation as one text (the messages in order, nothing between
   them), tokenized as the tokenizer tokenizes a prompt (its BOS where its post-processor adds one);
4. the built-in ChatML template with Qwen's vision tokens (:data:`CHATML`): for a model with a vision
   section (images need a template) and for the byte-level tokenizer of random-weight demo models.

Rendering matches transformers: a sandboxed Jinja environment with ``trim_blocks`` and ``lstrip_blocks``
and the loop-controls extension, its ``tojson`` (no HTML escaping), ``raise_exception`` and
``strftime_now``; the variables are ``messages``, ``add_generation_prompt``, ``tools`` / ``documents``
(none) and the special tokens of ``tokenizer_config.json`` (``bos_token``, ``eos_token``, ...). The
rendered text is tokenized with special tokens recognised and no tokens added, as ``apply_chat_template``
does. A message with images has a list content (``{"type": "image"}`` items, then ``{"type": "text"}``),
as transformers' processors pass them; a message without images has a string content.
"""
from __future__ import annotations

import json
import os
from datetime import datetime

from ..core.config import ConfigError

CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
"""The built-in template: ChatML, images as ``<|vision_start|><|image_pad|><|vision_end|>``."""

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """A template that cannot render a conversation (the template's own ``raise_exception`` included)."""


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # AddedToken as tokenizer_config.json writes it
        value = value.get("content")
    return value if isinstance(value, str) else None


def find_template(tokenizer_dir: str, explicit: str = "") -> tuple[str, str]:
    """(template source, where it came from) per the module docstring; ("", "") when there is none."""
    if explicit:
        if not os.path.isfile(explicit):
            raise ConfigError(f"tokenizer.chat_template: {explicit!r} does not exist")
        with open(explicit, encoding="utf-8") as fh:
            return fh.read(), explicit
    if not tokenizer_dir:
        return "", ""
    path = os.path.join(tokenizer_dir, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as fh:
            return fh.read(), path
    for name in ("chat_template.json", "tokenizer_config.json"):
        path = os.path.join(tokenizer_dir, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as fh:
                value = json.load(fh).get("chat_template")
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path}: not readable JSON ({exc})") from None
        if isinstance(value, list):  # named templates
            value = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}.get("default")
        if isinstance(value, str) and value.strip():
            return value, path
    return "", ""


def special_tokens(tokenizer_dir: str) -> dict[str, str]:
    """``bos_token``, ``eos_token``, ... of ``tokenizer_config.json`` beside the tokenizer (as strings)."""
    path = os.path.join(tokenizer_dir, "tokenizer_config.json") if tokenizer_dir else ""
    if not path or not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as fh:
            raw = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not readable JSON ({exc})") from None
    return {k: t for k in SPECIAL_KEYS if (t := _token_text(raw.get(k))) is not None}


class ChatTemplate:
    """A compiled chat template: ``render(messages)`` -> text, as transformers renders it."""

    plain = False
    """The rendered text is chat markup: special tokens in it become their ids, nothing is added."""

    def __init__(self, source: str = "", origin: str = "", specials: dict | None = None):
        try:
            import jinja2
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise ConfigError("chat templates need the 'jinja2' package (pip install jinja2; python3-jinja2)") \
                from None
        self.source = source or CHATML
        self.origin = origin or "built-in ChatML"
        self.specials = dict(specials or {})

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._jinja = jinja2
        try:
            self._template = env.from_string(self.source)
        except jinja2.exceptions.TemplateError as exc:
            raise ConfigError(f"chat template ({self.origin}) does not compile: {exc}") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self.specials)
        except self._jinja.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the chat template ({self.origin}) refuses this conversation: {exc}") from None


class PlainCompletion:
    """A base model's "template": the conversation as one text, each message's content after the last (a turn
    continues the session's text, the reply included), tokenized as a prompt (``Tokenizer.encode_prompt``)."""

    plain = True
    source = ""

    def __init__(self, origin: str):
        self.origin = origin

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        parts = []
        for m in messages:
            if not isinstance(m["content"], str):
                raise ChatTemplateError(f"{self.origin} takes text only: a message with images needs a chat "
                                        f"template that places them (tokenizer.chat_template)")
            parts.append(m["content"])
        return "".join(parts)


def load_chat_template(tokenizer_dir: str, explicit: str = "",
                       text_only: bool = False) -> ChatTemplate | PlainCompletion:
    """The template per the module docstring; ``text_only``: the model has no vision section, so a checkpoint
    tokenizer without a template is served as plain completion."""
    source, origin = find_template(tokenizer_dir, explicit)
    if not source and text_only and tokenizer_dir and os.path.isfile(os.path.join(tokenizer_dir, "tokenizer.json")):
        return PlainCompletion(f"plain text completion (no chat template beside {tokenizer_dir}/tokenizer.json)")
    return ChatTemplate(source, origin, special_tokens(tokenizer_dir))

"""Tokenizers: a Hugging Face ``tokenizer.json`` when the config names one, byte-level otherwise.

The runtimes need, besides encode/decode, a few special tokens of the chat template
(``<|im_start|>``, ``<|im_end|>``, ``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``) and the
end-of-sequence ids.
"""
from __future__ import annotations

import abc
import os

from ..core.config import ConfigError, ModelConfig

CHAT_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>")


class Tokenizer(abc.ABC):
    """Text <-> token ids, the chat template's special tokens and the end-of-sequence ids."""
    vocab_size: int
    eos_ids: tuple[int, ...]

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        ...

    @abc.abstractmethod
    def decode(self, ids) -> str:
        ...

    @abc.abstractmethod
    def special(self, token: str) -> int:
        """Id of a special token such as ``<|im_start|>``; KeyError if the vocabulary lacks it."""

    @abc.abstractmethod
    def encode_chat(self, text: str) -> list[int]:
        """A rendered chat template: special tokens written in it become their ids (user text goes
        through :meth:`encode`, where they stay text)."""

    def encode_prompt(self, text: str) -> list[int]:
        """Text as a base model reads a prompt: with the tokens the tokenizer adds around one (a BOS)."""
        return self.encode(text)

    @property
    def base_vocab_size(self) -> int:
        """Ids of the vocabulary without the tokens added on top (transformers' ``tokenizer.vocab_size``)."""
        return self.vocab_size

    def token_id(self, token: str) -> int:
        """Id of a token of the vocabulary by its text (special or not); KeyError if there is none."""
        return self.special(token)

    def token_text(self, token_id: int) -> str:
        """The vocabulary's text of a token id (transformers' ``convert_ids_to_tokens``)."""
        return self.decode([token_id])

    special_strings: frozenset = frozenset()
    """The text of every special token (a chat message holding one is refused: it would become a token)."""

    directory: str = ""
    """Where the tokenizer's files are (the chat template and tokenizer_config.json are looked up there)."""


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes are ids 0..255; the chat specials follow at 256.. (vocab must have room)."""

    def __init__(self, vocab_size: int, eos_ids: tuple[int, ...] = ()):
        needed = 256 + len(CHAT_SPECIALS)
        if vocab_size < needed:
            raise ConfigError(f"llm.vocab_size: the byte-level tokenizer needs at least {needed} ids, "
                              f"got {vocab_size}")
        self.vocab_size = vocab_size
        self._specials = {tok: 256 + i for i, tok in enumerate(CHAT_SPECIALS)}
        self.eos_ids = tuple(eos_ids) or (self._specials["<|im_end|>"], self._specials["<|endoftext|>"])
        self.special_strings = frozenset(CHAT_SPECIALS)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_chat(self, text: str) -> list[int]:
        out, i = [], 0
        while i < len(text):
            for tok in CHAT_SPECIALS:
                if text.startswith(tok, i):
                    out.append(self._specials[tok])
                    i += len(tok)
                    break
            else:
                j = min([k for k in (text.find(t, i) for t in CHAT_SPECIALS) if k >= 0] or [len(text)])
                out += list(text[i:j].encode("utf-8"))
                i = j
        return out

    def decode(self, ids) -> str:
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def special(self, token: str) -> int:
        return self._specials[token]


class HFTokenizer(Tokenizer):
    """A ``tokenizer.json`` file read with the ``tokenizers`` library (no hub access needed)."""

    def __init__(self, path: str, vocab_size: int, eos_ids: tuple[int, ...] = ()):
        try:
            from tokenizers import Tokenizer as _Tok
        except ImportError:
            raise ConfigError("tokenizer.path: reading tokenizer.json needs the 'tokenizers' package "
                              "(pip install tokenizers)") from None
        if not os.path.isfile(path):
            raise ConfigError(f"tokenizer.path: {path!r} does not exist")
        self._tok = _Tok.from_file(path)
        # Text typed by a user is text: "<|im_end|>" in a prompt must not become the special token and
        # break out of the chat template. The runtimes insert special tokens by id, or render the chat
        # template and encode that with encode_chat.
        self._tok.encode_special_tokens = True
        self._chat_tok = _Tok.from_file(path)
        self.special_strings = frozenset(t.content for t in self._tok.get_added_tokens_decoder().values()
                                         if t.special)
        self.vocab_size = vocab_size
        n = self._tok.get_vocab_size(with_added_tokens=True)
        if n > vocab_size:
            raise ConfigError(f"tokenizer.path: {path!r} has {n} tokens but llm.vocab_size is {vocab_size}")
        self.directory = os.path.dirname(os.path.abspath(path))
        if not eos_ids:  # the checkpoint's eos_token (tokenizer_config.json), else the usual ones
            from .chat_template import special_tokens
            named = special_tokens(self.directory).get("eos_token")
            found = [self._tok.token_to_id(t) for t in (named, "<|im_end|>", "<|endoftext|>", "</s>", "<eos>") if t]
            eos_ids = tuple(dict.fromkeys(i for i in found if i is not None))
        self.eos_ids = tuple(eos_ids)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_chat(self, text: str) -> list[int]:
        return self._chat_tok.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """With the tokens tokenizer.json's post-processor adds (transformers' ``tokenizer(text)``)."""
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def special(self, token: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise KeyError(token)
        return i

    def token_text(self, token_id: int) -> str:
        return self._tok.id_to_token(int(token_id)) or ""

    @property
    def base_vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=False)


def load_tokenizer(cfg: ModelConfig, shipped: str = "") -> Tokenizer:
    """The config's tokenizer.json, else ``shipped`` (the one a graph set ships), else byte-level."""
    eos = cfg.text.eos_token_ids
    path = cfg.relative_to_source(cfg.tokenizer.path) or shipped
    if path:
        return HFTokenizer(path, cfg.llm.vocab_size, eos)
    return ByteTokenizer(cfg.llm.vocab_size, eos)

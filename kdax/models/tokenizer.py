"""A checkpoint directory's tokenizer for ``kdax generate``: its ``tokenizer.json`` through the
``tokenizers`` library, or bytes (kdax train's models); its chat template rendered with jinja2,
as transformers' ``apply_chat_template`` does; its end-of-sequence tokens."""

from __future__ import annotations

import datetime
import json
import os

import jinja2
import jinja2.sandbox
import tokenizers


def _read_json(directory: str, name: str) -> dict:
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _content(token) -> str | None:  # tokenizer_config.json writes a special token as a string or {"content": ...}
    return token.get("content") if isinstance(token, dict) else token


def _chat_template(directory: str, config: dict) -> str | None:
    """The template of chat_template.jinja, chat_template.json or tokenizer_config.json (where a
    list of named templates, the "default" one), or None."""
    path = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path) as f:
            return f.read()
    template = _read_json(directory, "chat_template.json").get("chat_template", config.get("chat_template"))
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    return template


class Tokenizer:
    """Text to ids and back for one checkpoint.

    Attributes:
        name: "tokenizer.json" or "bytes".
        eos_token_ids: the ids that end a generation (generation_config.json's or config.json's
            ``eos_token_id``, else the tokenizer's eos token), possibly empty.
        chat_template: the jinja template, or None.
    """

    def __init__(self, directory: str, vocab_size: int):
        """Load ``directory``'s tokenizer.

        Raises:
            ValueError: the directory has no tokenizer.json and its model's ``vocab_size`` is
                below 256 (bytes do not fit), or a tokenizer id is outside [0, vocab_size).
        """
        path = os.path.join(directory, "tokenizer.json")
        self._config = _read_json(directory, "tokenizer_config.json")
        self.chat_template = _chat_template(directory, self._config)
        if os.path.isfile(path):
            self.name, self._tok = "tokenizer.json", tokenizers.Tokenizer.from_file(path)
            if self._tok.get_vocab_size() > vocab_size:
                raise ValueError(
                    f"checkpoint: its tokenizer.json has {self._tok.get_vocab_size()} tokens, more than the "
                    f"model's vocab_size {vocab_size}"
                )
        elif vocab_size >= 256:
            self.name, self._tok = "bytes", None
        else:
            hint = (
                " (tiktoken.model: write a tokenizer.json with transformers' "
                "AutoTokenizer.from_pretrained(dir).save_pretrained(dir))"
                if os.path.isfile(os.path.join(directory, "tiktoken.model"))
                else ""
            )
            raise ValueError(
                f"checkpoint: expected a tokenizer.json in {directory!r}, or a vocab_size of at least 256 for "
                f"bytes, got vocab_size {vocab_size}{hint}"
            )
        self.eos_token_ids = self._eos(directory)

    def _eos(self, directory: str) -> tuple[int, ...]:
        for source in (_read_json(directory, "generation_config.json"), _read_json(directory, "config.json")):
            eos = source.get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (eos,)
        name = _content(self._config.get("eos_token"))
        if name is not None and self._tok is not None and self._tok.token_to_id(name) is not None:
            return (self._tok.token_to_id(name),)
        return ()

    def encode(self, text: str, special_tokens: bool = True) -> list[int]:
        """The ids of ``text`` (with the tokenizer's own special tokens, such as a BOS, unless
        ``special_tokens`` is False)."""
        if self._tok is None:
            return list(text.encode("utf-8"))
        return self._tok.encode(text, add_special_tokens=special_tokens).ids

    def decode(self, ids) -> str:
        """The text of ``ids``, special tokens skipped; an incomplete UTF-8 sequence at the end is
        left out (the next ids complete it)."""
        if self._tok is None:
            return bytes(int(i) for i in ids if i < 256).decode("utf-8", errors="ignore")
        text = self._tok.decode([int(i) for i in ids], skip_special_tokens=True)
        return text[:-1] if text.endswith("\ufffd") else text

    def chat(self, messages: list[dict]) -> list[int]:
        """The ids of ``messages`` ([{"role": ..., "content": ...}]) in the chat template, with
        the assistant's turn opened (``add_generation_prompt``).

        Raises:
            ValueError: the checkpoint has no chat template.
        """
        if self.chat_template is None:
            raise ValueError(
                "chat: the checkpoint has no chat template (tokenizer_config.json's chat_template or "
                "chat_template.jinja); leave --chat out to continue the prompt as text"
            )

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.datetime.now().strftime(f))
        special = {k: _content(v) for k, v in self._config.items() if k.endswith("_token")}
        text = env.from_string(self.chat_template).render(messages=messages, add_generation_prompt=True, **special)
        return self.encode(text, special_tokens=False)  # the template writes the special tokens itself

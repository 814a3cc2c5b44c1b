"""Chat tasks (task_type "chat"): their stored request, and the gateway's count of an input's tokens.

A chat task's `request_payload` holds its messages and generation parameters (`messages`, `max_output_tokens`,
`temperature`, `top_p`, `stop`, `seed`) and the input's token count (`input_tokens`). The gateway counts tokens with
the model's own tokenizer (`tokenizer.json`, read by the `tokenizers` library: no torch) after rendering the model's
chat template with a sandboxed Jinja environment, as transformers' `apply_chat_template` does; the worker's count of
the same messages is the same number.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

TASK_TYPE = "chat"
ROLES = ("system", "user", "assistant")
MESSAGES = "messages"  # the payload's keys
INPUT_TOKENS = "input_tokens"


def messages_of(payload: dict[str, Any]) -> list[dict[str, str]]:
    """A chat task's conversation from its stored payload."""
    return [{"role": str(m["role"]), "content": str(m["content"])} for m in payload.get(MESSAGES, [])]


def reservation(payload: dict[str, Any]) -> int:
    """The tokens a chat task reserves of its tenant's token budget at admission: its input as counted and the most
    it may generate."""
    return int(payload.get(INPUT_TOKENS, 0)) + int(payload["max_output_tokens"])


def preview(messages: list[dict[str, str]], limit: int) -> str:
    """What a chat task shows as its prompt: the beginning of its last user turn."""
    last = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
    return last[:limit]


class TokenizerMissing(Exception):
    """The model's tokenizer or chat template could not be read (an operator's problem, not the request's)."""


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's dict."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return str(value) if value is not None else ""


def _raise(message: str) -> None:
    raise TemplateError(message)


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """One model's tokenizer and chat template, as the gateway counts an input with them."""

    tokenizer: Any  # tokenizers.Tokenizer
    template: Any  # a compiled jinja2 Template
    bos_token: str
    eos_token: str

    @classmethod
    def load(cls, where: Path) -> ChatTemplate:
        """From a model folder (tokenizer.json, tokenizer_config.json, chat_template.jinja) or a tokenizer.json."""
        from tokenizers import Tokenizer

        folder = where.parent if where.suffix == ".json" else where
        tokenizer_file = where if where.suffix == ".json" else where / "tokenizer.json"
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
            config_file = folder / "tokenizer_config.json"
            config = json.loads(config_file.read_text()) if config_file.is_file() else {}
            jinja_file = folder / "chat_template.jinja"
            source = jinja_file.read_text() if jinja_file.is_file() else config.get("chat_template")
        except (OSError, ValueError, Exception) as exc:  # tokenizers raises plain Exception on a bad file
            raise TokenizerMissing(f"{tokenizer_file}: {exc}") from exc
        if not isinstance(source, str):
            raise TokenizerMissing(f"{folder} has no chat template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return cls(
            tokenizer,
            env.from_string(source),
            _token_text(config.get("bos_token")),
            _token_text(config.get("eos_token")),
        )

    def render(self, messages: list[dict[str, str]]) -> str:
        """The model's input text for a conversation, ending where the assistant's answer begins."""
        return str(self.template.render(
            messages=messages, add_generation_prompt=True, bos_token=self.bos_token, eos_token=self.eos_token,
        ))

    def count(self, messages: list[dict[str, str]]) -> int:
        """Tokens of the rendered conversation (the template writes the special tokens it wants)."""
        return len(self.tokenizer.encode(self.render(messages), add_special_tokens=False).ids)


class ChatTemplates:
    """Each model's ChatTemplate, loaded once (a failed load is tried again on the next request)."""

    def __init__(self) -> None:
        self._loaded: dict[Path, ChatTemplate] = {}
        self._lock = threading.Lock()  # counts run in threads: two first requests load once

    def get(self, where: Path) -> ChatTemplate:
        with self._lock:
            found = self._loaded.get(where)
            if found is None:
                found = self._loaded[where] = ChatTemplate.load(where)
            return found

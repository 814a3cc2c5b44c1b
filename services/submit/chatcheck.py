"""A chat task's request checked and put in canonical form (services/submit/validation.py checks the rest): its
conversation with the uploaded texts it names, its generation parameters with the model's defaults, and its input
counted with the model's tokenizer."""

from __future__ import annotations

import asyncio
import math
from typing import Any

from taskgate import chat, errors, text
from taskgate.config import GatewaySettings, ModelSpec
from taskgate_api.v1 import gateway_pb2

from .inputs import InputImages

MAX_SEED = 2**63 - 1
MAX_STOP_CHARS = 64  # one stop string's length
MAX_TEMPERATURE = 2.0
_TEMPLATES = chat.ChatTemplates()  # each chat model's tokenizer, loaded once per process


async def attachments(
    tenant: str, req: gateway_pb2.SubmitTaskRequest, inputs: InputImages | None, bad: list[tuple[str, str]], *,
    within: float,
) -> dict[int, str]:
    """The texts a chat request's messages name by content_sha256 (uploaded with UploadInput), by message index;
    each one the tenant does not hold is a violation naming its field."""
    named = [(i, m.content_sha256) for i, m in enumerate(req.chat.messages) if m.content_sha256]
    if named and inputs is None:
        bad.append((f"chat.messages[{named[0][0]}].content_sha256", "this gateway takes no text attachments"))
        return {}
    found = {}
    for i, sha256 in named:
        assert inputs is not None
        got = await inputs.text_of(tenant, sha256, f"chat.messages[{i}].content_sha256", bad, within=within)
        if got is not None:
            found[i] = got
    return found


def check_chat(
    req: gateway_pb2.SubmitTaskRequest, spec: ModelSpec, settings: GatewaySettings, bad: list[tuple[str, str]],
    attached: dict[int, str] | None = None,
) -> dict[str, Any]:
    """A chat request's conversation and generation parameters, defaults filled from the model spec; each bad value
    recorded. Text may hold any character PostgreSQL stores (documents and diffs carry tabs, CRs and form feeds).
    `attached`: the uploaded texts its messages name, by index, each appended to its message's content (after a
    blank line when the content is not empty)."""
    c = req.chat
    messages: list[dict[str, str]] = []
    attached = attached or {}
    if c.messages:
        if req.prompt:
            bad.append(("prompt", "give the prompt or chat.messages, not both"))
        for i, m in enumerate(c.messages):
            if m.role not in chat.ROLES:
                bad.append((f"chat.messages[{i}].role", f"must be one of {', '.join(chat.ROLES)}"))
            text.check(f"chat.messages[{i}].content", [m.content], bad)
            content = m.content
            if i in attached:
                content = f"{content}\n\n{attached[i]}" if content else attached[i]
            messages.append({"role": m.role, "content": content})
        if c.messages[-1].role != "user":
            bad.append((f"chat.messages[{len(c.messages) - 1}].role", "the last message must be the user's"))
        field = "chat.messages"
    else:
        if not req.prompt.strip():
            bad.append(("prompt", "must not be empty (or give chat.messages)"))
        text.check("prompt", [req.prompt], bad)
        messages.append({"role": "user", "content": req.prompt})
        field = "prompt"
    chars = sum(len(m["content"]) for m in messages)
    if chars > settings.max_input_chars:
        bad.append((field, f"{chars} characters; at most {settings.max_input_chars}"))
    max_tokens = c.max_output_tokens if c.HasField("max_output_tokens") else spec.default_max_output_tokens
    if not 1 <= max_tokens <= spec.max_output_tokens:
        bad.append(("chat.max_output_tokens", f"must be 1..{spec.max_output_tokens}"))
    temperature = float(c.temperature) if c.HasField("temperature") else spec.default_temperature
    if not math.isfinite(temperature) or not 0 <= temperature <= MAX_TEMPERATURE:
        bad.append(("chat.temperature", f"must be 0..{MAX_TEMPERATURE:g}"))
    top_p = float(c.top_p) if c.HasField("top_p") else spec.default_top_p
    if not math.isfinite(top_p) or not 0 < top_p <= 1:
        bad.append(("chat.top_p", "must be above 0 and at most 1"))
    stop = list(c.stop)
    if len(stop) > settings.max_stop_sequences:
        bad.append(("chat.stop", f"at most {settings.max_stop_sequences} strings"))
    elif any(not s or len(s) > MAX_STOP_CHARS for s in stop):
        bad.append(("chat.stop", f"each must be 1..{MAX_STOP_CHARS} characters"))
    else:
        text.check("chat.stop", stop, bad)
    if c.HasField("seed") and not 0 <= c.seed <= MAX_SEED:
        bad.append(("chat.seed", "must not be negative"))
    return {
        chat.MESSAGES: messages,
        "max_output_tokens": max_tokens,
        # float32 on the wire: round so 0.7 is stored as 0.7
        "temperature": round(temperature, 4) if math.isfinite(temperature) else 0.0,
        "top_p": round(top_p, 4) if math.isfinite(top_p) else 1.0,
        "stop": stop,
        "seed": int(c.seed) if c.HasField("seed") else None,
        chat.INPUT_TOKENS: 0,
        "_field": field,
    }


async def check_input_tokens(
    req: gateway_pb2.SubmitTaskRequest, spec: ModelSpec, params: dict[str, Any], bad: list[tuple[str, str]]
) -> None:
    """Counts the input with the model's tokenizer (in a thread: a megabyte takes a while) into the payload; over
    the model's max_input_tokens is a violation naming the input's field."""
    field = params.pop("_field")
    where = spec.tokenizer or spec.path
    if where is None:  # a stand-in ('sleep') chat model without files: nothing to count with
        return
    try:
        template = await asyncio.to_thread(_TEMPLATES.get, where)
        counted = await asyncio.to_thread(template.count, params[chat.MESSAGES])
    except chat.TokenizerMissing as exc:
        raise errors.unavailable(f"the model's tokenizer cannot be read: {exc}", retry_after=5.0) from None
    except Exception as exc:  # a template that raises on this conversation (raise_exception, a bad role order)
        bad.append((field, f"the model's chat template refuses it: {exc}"))
        return
    params[chat.INPUT_TOKENS] = counted
    if counted > spec.max_input_tokens:
        bad.append(
            (field, f"{counted} tokens; model {req.model_id or 'default'} takes at most {spec.max_input_tokens}")
        )


"""Rows for tests, inserted by the store function that also inserts the submit service's tasks."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from taskgate import auth, ids
from taskgate.model import TaskRow
from taskgate.runtime import Backends
from taskgate.store import Conn, submissions

Metadata = tuple[tuple[str, str], ...]


async def insert_task(
    db: Conn,
    *,
    user_id: str = "tenant-a",
    model_id: str = "wan-tiny",
    prompt: str = "a red fox in the snow",
    priority: int = 5,
    callback_url: str | None = None,
    params: dict[str, Any] | None = None,
    max_retries: int = 3,
) -> TaskRow:
    payload = params or {"num_frames": 9, "width": 32, "height": 32, "num_inference_steps": 2,
                         "guidance_scale": 5.0, "fps": 8, "seed": 1, "negative_prompt": ""}
    task_id = ids.new_id()
    digest = hashlib.sha256(json.dumps([user_id, model_id, prompt, payload], sort_keys=True).encode()).hexdigest()
    task = await submissions.create(
        db,
        submissions.NewTask(
            id=task_id, user_id=user_id, idempotency_key=f"k-{task_id}", key_derived=False, request_hash=digest,
            task_type="text-to-video", model_id=model_id, prompt=prompt, payload=payload, metadata={}, priority=priority,
            max_retries=max_retries, callback_url=callback_url, callback_events=[],
        ),
    )
    assert task is not None
    return task


async def key_for(backends: Backends, tenant: str = "tenant-a", **limits: Any) -> Metadata:
    """Call metadata carrying a fresh API key of `tenant` (limits as taskgate.auth.create_key takes them)."""
    key, _ = await auth.create_key(backends.pool, backends.settings.api_key_pepper, tenant, **limits)
    return (("authorization", f"Bearer {key}"),)

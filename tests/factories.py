"""Rows for tests, inserted the way the submit service inserts them."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import asyncpg

from taskgate import auth, ids, sql
from taskgate.model import TaskRow
from taskgate.runtime import Backends

Metadata = tuple[tuple[str, str], ...]


async def insert_task(
    db: asyncpg.Pool | asyncpg.Connection,
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
    rec = await db.fetchrow(
        sql.query("insert_task"),
        task_id, user_id, f"k-{task_id}", False, digest, "text-to-video", model_id, prompt, payload, {},
        priority, f"{model_id}.{priority}", max_retries, callback_url, [],
    )
    assert rec is not None
    return TaskRow.from_record(rec)


async def key_for(backends: Backends, tenant: str = "tenant-a", **limits: Any) -> Metadata:
    """Call metadata carrying a fresh API key of `tenant` (limits as taskgate.auth.create_key takes them)."""
    key, _ = await auth.create_key(backends.pool, backends.settings.api_key_pepper, tenant, **limits)
    return (("authorization", f"Bearer {key}"),)

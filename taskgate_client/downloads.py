"""Writing a finished task's output to a file: from its result URL, checked against its size and sha256."""

from __future__ import annotations

import hashlib
import urllib.request
from pathlib import Path
from typing import Any

import grpc

from taskgate_api import reasons
from taskgate_client.errors import IntegrityError
from taskgate_client.types import TaskResult

DOWNLOAD_CHUNK = 256 * 1024


def check_integrity(info: TaskResult, size: int, digest: Any) -> None:
    if size != info.size_bytes or digest.hexdigest() != info.sha256:
        raise IntegrityError(
            grpc.StatusCode.DATA_LOSS,
            f"downloaded {size} bytes with sha256 {digest.hexdigest()[:16]}…, "
            f"expected {info.size_bytes} bytes with sha256 {info.sha256[:16]}…",
            reason=reasons.CHECKSUM_MISMATCH,
        )


def fetch_url(info: TaskResult, target: Path, timeout: float) -> TaskResult:
    """GETs the output from its result URL into `target` (blocking; run in a thread), checking size and sha256."""
    partial = target.with_name(target.name + ".part")
    digest = hashlib.sha256()
    size = 0
    complete = False
    try:
        with urllib.request.urlopen(info.url, timeout=timeout) as response, partial.open("wb") as out:
            while chunk := response.read(DOWNLOAD_CHUNK):
                digest.update(chunk)
                size += len(chunk)
                out.write(chunk)
        check_integrity(info, size, digest)
        complete = True
    finally:
        if not complete:
            partial.unlink(missing_ok=True)
    partial.replace(target)
    return info

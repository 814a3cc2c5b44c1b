"""What Python 3.10 lacks and the SDK uses: the client package supports 3.10, the server needs 3.11."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import sys
from collections.abc import AsyncIterator
from datetime import timezone

UTC = timezone.utc

if sys.version_info >= (3, 11):
    from asyncio import timeout
    from enum import StrEnum
else:

    class StrEnum(str, enum.Enum):
        """enum.StrEnum of 3.11: members are their values as str."""

        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, spec: str) -> str:
            return format(str(self.value), spec)

    @contextlib.asynccontextmanager
    async def timeout(delay: float | None) -> AsyncIterator[None]:
        """asyncio.timeout of 3.11: cancels the block after `delay` seconds and raises TimeoutError."""
        if delay is None:
            yield
            return
        task = asyncio.current_task()
        assert task is not None
        fired = False

        def fire() -> None:
            nonlocal fired
            fired = True
            task.cancel()

        handle = asyncio.get_running_loop().call_later(delay, fire)
        try:
            yield
        except asyncio.CancelledError:
            if fired:
                raise TimeoutError from None
            raise
        finally:
            handle.cancel()


__all__ = ["UTC", "StrEnum", "timeout"]

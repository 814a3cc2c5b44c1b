"""The fake taskgate's gRPC surface (see taskgate_client.testing): the errors a real call fails with, a streaming
call, and a stub that serves the named RPCs and answers any other UNIMPLEMENTED."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2

from taskgate_api import reasons


def rpc_error(code: grpc.StatusCode, message: str, *details: Message) -> grpc.aio.AioRpcError:
    """The error a real call fails with: `code`, `message` and google.rpc details in the trailing metadata."""
    packed = []
    for detail in details:
        anyp = any_pb2.Any()
        anyp.Pack(detail)
        packed.append(anyp)
    status = status_pb2.Status(code=code.value[0], message=message, details=packed)
    trailing = grpc.aio.Metadata(("grpc-status-details-bin", status.SerializeToString()))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details=message)


def _info(reason: str, **metadata: str) -> error_details_pb2.ErrorInfo:
    return error_details_pb2.ErrorInfo(reason=reason, domain=reasons.DOMAIN, metadata=metadata)


def _invalid(violations: list[tuple[str, str]]) -> grpc.aio.AioRpcError:
    bad = error_details_pb2.BadRequest(
        field_violations=[error_details_pb2.BadRequest.FieldViolation(field=f, description=d) for f, d in violations]
    )
    summary = "; ".join(f"{f}: {d}" for f, d in violations)
    return rpc_error(grpc.StatusCode.INVALID_ARGUMENT, f"invalid request: {summary}", bad)


def _not_found(what: str = "task") -> grpc.aio.AioRpcError:
    return rpc_error(grpc.StatusCode.NOT_FOUND, f"{what} not found", _info(reasons.NOT_FOUND))


class _Call:
    """A server-streaming call: iterate it, cancel it."""

    def __init__(self, source: AsyncIterator[Any]) -> None:
        self._source = source

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._source

    def cancel(self) -> bool:
        return True


class _Unimplemented:
    """What an RPC the fake does not serve returns, awaited or iterated: UNIMPLEMENTED."""

    def __init__(self, name: str) -> None:
        self._error = rpc_error(grpc.StatusCode.UNIMPLEMENTED, f"the fake taskgate does not serve {name}")

    async def _fail(self) -> NoReturn:
        raise self._error

    def __await__(self) -> Any:
        return self._fail().__await__()

    def __aiter__(self) -> _Unimplemented:
        return self

    async def initial_metadata(self) -> tuple[()]:  # a stream's headers: none, the call is over
        return ()

    def done(self) -> bool:
        return True

    async def __anext__(self) -> NoReturn:
        raise self._error

    def cancel(self) -> bool:
        return True


class _Stub:
    """Serves the named RPCs from `methods`; any other is UNIMPLEMENTED, as on a server without it."""

    def __init__(self, methods: dict[str, Callable[..., Any]]) -> None:
        self._methods = methods

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = self._methods.get(name)
        if method is not None:
            return method
        return lambda *args, **kwargs: _Unimplemented(name)



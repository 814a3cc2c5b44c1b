"""What every call of the asyncio client stands on: its channels and stubs, the call metadata, the retries, and
reading one task (GetTask). `AsyncTaskgateClient` (aio.py) is this plus its calls, grouped in mixins by what they do."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar, cast

import grpc
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from taskgate_api.v1 import admin_pb2_grpc, events_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from taskgate_client import tracecontext
from taskgate_client.config import ClientConfig, channel_target
from taskgate_client.errors import TaskgateError, from_rpc_error, retryable
from taskgate_client.handles import AsyncTaskHandle
from taskgate_client.pipeline import SubmitPipe
from taskgate_client.types import Task

if TYPE_CHECKING:
    from taskgate_client.aio import AsyncTaskgateClient

T = TypeVar("T")

DEFAULT_POLL_SECONDS = 1.0


class _ServerHintedWait:
    """Exponential backoff with jitter, but never sooner than the server's RetryInfo asks."""

    def __init__(self, max_delay: float) -> None:
        self._max = max_delay
        self._base = wait_exponential_jitter(initial=0.1, max=max_delay)

    def __call__(self, state: RetryCallState) -> float:
        delay = float(self._base(state))
        exc = state.outcome.exception() if state.outcome is not None else None
        if isinstance(exc, TaskgateError) and exc.retry_delay:
            delay = max(delay, min(exc.retry_delay, self._max))
        return delay


class ClientCore:
    """The asyncio client's channels, stubs, metadata and retried unary call (see AsyncTaskgateClient)."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config.resolved()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._pipes: dict[str, SubmitPipe] = {}  # the submit stream of each gateway channel
        self.retries = 0
        """How many times a call was retried after UNAVAILABLE or a retryable ABORTED (for metrics and tests)."""

    async def close(self) -> None:
        """Closes every channel; in-flight calls are cancelled."""
        pipes, self._pipes = list(self._pipes.values()), {}
        for pipe in pipes:
            await pipe.close()
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()

    # -- plumbing ---------------------------------------------------------------------------------------------

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            creds = self.config.channel_credentials()
            options = self.config.channel_options()
            if creds is None:
                channel = grpc.aio.insecure_channel(channel_target(address), options=options)
            else:
                channel = grpc.aio.secure_channel(channel_target(address), creds, options=options)
            self._channels[address] = channel
        return channel

    @property
    def _gateway(self) -> gateway_pb2_grpc.TaskGatewayAsyncStub:
        return cast(
            "gateway_pb2_grpc.TaskGatewayAsyncStub",
            gateway_pb2_grpc.TaskGatewayStub(self._channel(self.config.address)),
        )

    @property
    def _events(self) -> events_pb2_grpc.TaskEventsAsyncStub:
        assert self.config.events_address is not None
        return cast(
            "events_pb2_grpc.TaskEventsAsyncStub",
            events_pb2_grpc.TaskEventsStub(self._channel(self.config.events_address)),
        )

    @property
    def admin_stub(self) -> admin_pb2_grpc.TaskAdminAsyncStub:
        """The raw TaskAdmin stub (pass `admin_metadata` with each call)."""
        assert self.config.admin_address is not None
        return cast(
            "admin_pb2_grpc.TaskAdminAsyncStub", admin_pb2_grpc.TaskAdminStub(self._channel(self.config.admin_address))
        )

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata carrying the API key, and the caller's trace context when OpenTelemetry is installed."""
        auth = (("authorization", f"Bearer {self.config.api_key}"),) if self.config.api_key else ()
        return auth + tracecontext.metadata()

    @property
    def admin_metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata carrying the admin key (the API key when no admin key is set)."""
        key = self.config.admin_key or self.config.api_key
        return ((("authorization", f"Bearer {key}"),) if key else ()) + tracecontext.metadata()

    def _retrying(self) -> AsyncRetrying:
        return AsyncRetrying(
            retry=retry_if_exception(retryable),
            stop=stop_after_attempt(self.config.retry_attempts),
            wait=_ServerHintedWait(self.config.retry_max_delay),
            before_sleep=self._count_retry,
            reraise=True,
        )

    def _count_retry(self, state: RetryCallState) -> None:
        self.retries += 1

    def _handle(self, task: Task) -> AsyncTaskHandle:
        return AsyncTaskHandle.bind(task, cast("AsyncTaskgateClient", self))  # every client is a ClientCore

    async def _call(self, make: Callable[[], Awaitable[T]]) -> T:
        """Runs one unary call, retrying UNAVAILABLE (and ABORTED with RetryInfo) with backoff; errors become
        TaskgateError subclasses."""
        async for attempt in self._retrying():
            with attempt:
                try:
                    return await make()
                except grpc.aio.AioRpcError as exc:
                    raise from_rpc_error(exc) from None
        raise AssertionError("unreachable")  # pragma: no cover

    async def get_with_interval(self, task_id: str) -> tuple[Task, float]:
        """The task and how long the gateway suggests waiting before polling it again (seconds)."""
        request = gateway_pb2.GetTaskRequest(task_id=task_id)
        response = await self._call(
            lambda: self._gateway.GetTask(request, metadata=self.metadata, timeout=self.config.call_timeout)
        )
        interval = (
            response.suggested_poll_interval.ToNanoseconds() / 1e9
            if response.HasField("suggested_poll_interval")
            else 0
        )
        return Task.from_proto(response.task), interval or DEFAULT_POLL_SECONDS

    async def get(self, task_id: str) -> AsyncTaskHandle:
        """The task's current state."""
        return self._handle((await self.get_with_interval(task_id))[0])

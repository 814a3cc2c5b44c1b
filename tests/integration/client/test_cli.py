"""The `taskgate` CLI as a real subprocess against the real services: output contract and exit codes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from PIL import Image

from taskgate import auth, keys
from taskgate.states import Status as ServerStatus
from taskgate_client import Status
from taskgate_client.cli import EXIT_BY_STATUS, EXIT_SKIPPED, build_parser
from taskgate_client.local import LocalStack
from taskgate_local.embedded import free_port
from tests.support.factories import dead, put_in
from tests.support.harness import wait_for
from tests.support.stacks import Cli, Result


def one_error_line(result: Result, code: str) -> str:
    """The error contract: exactly one stderr line naming the status code, with a hint, and no traceback."""
    lines = result.err.strip().splitlines()
    assert len(lines) == 1, result.err
    assert lines[0].startswith(f"error: {code}: "), lines[0]
    assert "hint: " in lines[0] and "Traceback" not in result.err
    return lines[0]


async def test_submit_get_list_json(cli: Cli) -> None:
    submitted = await cli(
        "submit", "a fox", "--model", "sleepy", "--steps", "2", "--seed", "3", "--metadata", "k=v", "--json"
    )
    assert submitted.code == 0, submitted.err
    task = submitted.json()
    assert task["status"] in ("CREATED", "QUEUED", "PROCESSING", "SUCCEEDED") and task["created"] is True
    assert task["params"]["seed"] == 3 and task["metadata"] == {"k": "v"}
    got = await cli("get", task["task_id"], "--json")
    assert got.code == 0 and got.json()["task_id"] == task["task_id"]
    listed = await cli("--json", "list")
    assert [t["task_id"] for t in listed.json()["tasks"]] == [task["task_id"]]
    table = await cli("list")
    assert table.code == 0 and table.out.splitlines()[0].split()[:3] == ["TASK", "ID", "STATUS"]
    assert task["task_id"] in table.out
    human = await cli("get", task["task_id"])
    assert "task_id" in human.out and task["task_id"] in human.out


async def test_submit_wait_shows_progress_then_the_outcome_as_exit_code(cli: Cli) -> None:
    ok = await cli("submit", "runs fine", "--model", "sleepy", "--steps", "3", "--wait")
    assert ok.code == 0, ok.err
    assert "SUCCEEDED" in ok.out
    progress = [line for line in ok.err.splitlines() if "[" in line]
    assert any(line.startswith("PROCESSING") and "33%" in line for line in progress), ok.err
    assert progress[-1].startswith("SUCCEEDED") and "100%" in progress[-1]

    failed = await cli("submit", "breaks", "--model", "failing", "--max-retries", "0", "--wait", "--json")
    assert failed.code == EXIT_BY_STATUS[Status.FAILED] == 20, failed.err
    assert failed.json()["status"] == "FAILED" and failed.json()["error_code"] == "MODEL_CRASHED"
    assert "[" not in failed.err  # --json without a terminal: no progress bar mixed into the output


async def test_wait_gives_up_with_exit_11(cli: Cli) -> None:
    task = (await cli("submit", "never runs", "--json")).json()  # wan-tiny has no worker here
    waited = await cli("wait", task["task_id"], "--wait-timeout", "1.5")
    assert waited.code == 11
    assert "DEADLINE_EXCEEDED" in waited.err and "Traceback" not in waited.err
    assert any(line.startswith("QUEUED") and "queue position 1" in line for line in waited.err.splitlines()), waited.err


async def test_watch_prints_each_version_until_terminal(cli: Cli) -> None:
    task = (await cli("submit", "watch me", "--model", "sleepy", "--steps", "3", "--json")).json()
    watched = await cli("watch", task["task_id"], "--json")
    assert watched.code == 0, watched.err
    events = watched.lines()
    versions = [e["version"] for e in events]
    assert versions == list(range(versions[0], versions[0] + len(events)))
    assert events[-1]["status"] == "SUCCEEDED"
    human = await cli("watch", task["task_id"], "--after-version", "2")
    lines = human.out.strip().splitlines()
    # v2 is QUEUED, or already the claim when the worker's message outran the QUEUED commit (CREATED → PROCESSING)
    assert lines[0].startswith("v3 ") and "→ PROCESSING" in lines[0]
    assert "SUCCEEDED" in lines[-1]


async def test_cancel_and_result(cli: Cli, tmp_path: Path) -> None:
    queued = (await cli("submit", "cancel me", "--json")).json()
    canceled = await cli("cancel", queued["task_id"], "--hard", "--json")
    assert canceled.code == 0 and canceled.json()["status"] == "CANCELED"
    no_result = await cli("result", queued["task_id"], "-o", str(tmp_path / "x.mp4"))
    assert no_result.code == 8
    assert "TASK_NOT_SUCCEEDED" in one_error_line(no_result, "FAILED_PRECONDITION")

    done = await cli("submit", "keep me", "--model", "sleepy", "--steps", "1", "--wait", "--json")
    target = tmp_path / "out.json"
    fetched = await cli("result", done.json()["task_id"], "-o", str(target), "--json")
    assert fetched.code == 0, fetched.err
    info = fetched.json()
    assert target.stat().st_size == info["size_bytes"] and info["sha256"] == done.json()["result"]["sha256"]


async def test_grpc_errors_print_one_line_and_map_to_exit_codes(cli: Cli) -> None:
    missing = await cli("get", "4242")
    assert missing.code == 3
    one_error_line(missing, "NOT_FOUND")

    bad = await cli("submit", "bad sizes", "--frames", "8", "--width", "33")
    assert bad.code == 4
    line = one_error_line(bad, "INVALID_ARGUMENT")
    assert "params.num_frames" in line and "params.width" in line

    stranger = await cli("list", "--api-key", "tg_nobody")
    assert stranger.code == 6
    one_error_line(stranger, "UNAUTHENTICATED")

    not_admin = await cli("admin", "stats", env={"TASKGATE_ADMIN_KEY": cli.env["TASKGATE_API_KEY"]})
    assert not_admin.code == 7
    one_error_line(not_admin, "PERMISSION_DENIED")

    limited = await cli.key("tenant-slow", submits_per_minute=1)
    first = await cli("submit", "one", "--api-key", limited)
    assert first.code == 0
    second = await cli("submit", "two", "--api-key", limited, "--json")
    if second.code == 0:  # the first landed just before a minute boundary: this one opened the next window
        second = await cli("submit", "three", "--api-key", limited, "--json")
    assert second.code == 5
    assert "retry in" in one_error_line(second, "RESOURCE_EXHAUSTED")
    error = second.json()["error"]
    assert error["code"] == "RESOURCE_EXHAUSTED" and error["reason"] and error["retry_delay"] > 0

    down = await cli("get", "1", "--address", f"127.0.0.1:{free_port()}", "--timeout", "2")
    assert down.code == 10
    one_error_line(down, "UNAVAILABLE")

    usage = await cli("submit")
    assert usage.code == 2 and "Traceback" not in usage.err


async def test_keys_create_list_revoke(cli: Cli) -> None:
    created = await cli.keys("create", "--tenant", "bob", "--json")
    assert created.code == 0, created.err
    doc = created.json()
    assert doc["api_key"].startswith("tg_") and doc["webhook_secret"].startswith("whsec_")
    again = (await cli.keys("create", "--tenant", "bob", "--json")).json()
    assert again["webhook_secret"] is None  # shown once, when the tenant was created
    assert (await cli("list", "--api-key", doc["api_key"])).code == 0
    listed = (await cli.keys("list", "--json")).json()["keys"]
    assert {k["prefix"] for k in listed if k["tenant"] == "bob"} == {doc["prefix"], again["prefix"]}
    assert all("api_key" not in k for k in listed)
    revoked = await cli.keys("revoke", doc["prefix"])
    assert revoked.code == 0
    # The gateway caches a key's lookup for a few seconds; the revocation holds once that passes.

    async def refused() -> bool:
        code = (await cli("list", "--api-key", doc["api_key"])).code
        assert code in (0, 6), code  # still served from the cache, or refused: nothing else
        return code == 6

    await wait_for(refused, 20)
    assert (await cli.keys("revoke", doc["prefix"])).code == 3
    invalid = await cli.keys("create", "--tenant", "no spaces please")
    assert invalid.code == 4 and invalid.err.startswith("error: ")


async def test_keys_tenant_priority_and_unstorable_names(cli: Cli) -> None:
    created = await cli.keys("create", "--tenant", "vip", "--max-priority", "high", "--json")
    assert created.code == 0, created.err
    high = await cli("submit", "urgent", "--priority", "high", "--api-key", created.json()["api_key"], "--json")
    assert high.code == 0 and high.json()["priority"] == "high", high.err
    lowered = await cli.keys("tenant", "--tenant", "vip", "--max-priority", "NORMAL", "--max-pending", "7", "--json")
    assert lowered.code == 0 and lowered.json() == {
        "tenant": "vip", "max_pending": 7, "submits_per_minute": None, "max_priority": "NORMAL", "share_weight": 1.0,
        "gpu_seconds_per_day": None, "gpu_seconds_per_month": None, "max_pending_per_end_user": None,
        "submits_per_minute_per_end_user": None, "tokens_per_day": None, "tokens_per_month": None,
    }
    per_person = await cli.keys("tenant", "--tenant", "vip", "--max-pending-per-end-user", "5",
                                "--submits-per-minute-per-end-user", "12", "--json")
    assert (per_person.json()["max_pending_per_end_user"], per_person.json()["submits_per_minute_per_end_user"]) == (
        5,
        12,
    )
    weighted = await cli.keys("tenant", "--tenant", "vip", "--share-weight", "2.5", "--json")
    assert weighted.code == 0 and weighted.json()["share_weight"] == 2.5 and weighted.json()["max_pending"] == 7
    assert (await cli.keys("tenant", "--tenant", "vip", "--share-weight", "0")).code != 0
    budgeted = await cli.keys(
        "tenant", "--tenant", "vip", "--gpu-seconds-per-day", "3600", "--gpu-seconds-per-month", "1e5", "--json"
    )
    assert (budgeted.json()["gpu_seconds_per_day"], budgeted.json()["gpu_seconds_per_month"]) == (3600.0, 100000.0)
    unbudgeted = await cli.keys("tenant", "--tenant", "vip", "--gpu-seconds-per-day", "0", "--json")
    assert (unbudgeted.json()["gpu_seconds_per_day"], unbudgeted.json()["gpu_seconds_per_month"]) == (None, 100000.0)
    assert unbudgeted.json()["share_weight"] == 2.5
    assert (await cli.keys("tenant", "--tenant", "vip", "--gpu-seconds-per-day", "-1")).code == 2
    tokens = await cli.keys(
        "tenant", "--tenant", "vip", "--tokens-per-day", "50000", "--tokens-per-month", "1000000", "--json"
    )
    assert (tokens.json()["tokens_per_day"], tokens.json()["tokens_per_month"]) == (50000, 1000000)
    untokened = await cli.keys("tenant", "--tenant", "vip", "--tokens-per-month", "0", "--json")
    assert (untokened.json()["tokens_per_day"], untokened.json()["tokens_per_month"]) == (50000, None)
    assert untokened.json()["gpu_seconds_per_month"] == 100000.0
    assert (await cli.keys("tenant", "--tenant", "vip", "--tokens-per-day", "1.5")).code == 2
    fresh = (await cli.keys("create", "--tenant", "vip", "--json")).json()["api_key"]  # not in the gateway's key cache
    refused = await cli("submit", "urgent again", "--priority", "high", "--api-key", fresh)
    assert "PRIORITY" in one_error_line(refused, "PERMISSION_DENIED")
    assert (await cli.keys("tenant", "--tenant", "nobody", "--max-priority", "low")).code == 3
    assert (await cli.keys("create", "--tenant", "vip", "--max-priority", "urgent")).code == 2
    # A name that is not UTF-8 reaches Python as lone surrogates: refused before the database, with no traceback.
    bad = await cli.keys("create", "--tenant", "bad\udcffname")
    assert bad.code == 4 and bad.err.startswith("error: ") and "Traceback" not in bad.err
    assert not auth.valid_tenant_name("nul\x00name") and not auth.valid_tenant_name("ok\n")


async def _queued(cli: Cli, task_id: str) -> bool:
    return bool(await cli.backends.pool.fetchval("SELECT status = 'QUEUED' FROM task WHERE id = $1", int(task_id)))


async def test_admin_commands(cli: Cli) -> None:
    task = (await cli("submit", "for the operators", "--json")).json()
    await wait_for(lambda: _queued(cli, task["task_id"]))  # the dispatcher queues it after the answer
    stats = await cli("admin", "stats", "--json")
    assert stats.code == 0, stats.err
    counts = {(c["model_id"], c["status"]): int(c["count"]) for c in stats.json()["counts"]}
    assert counts[("wan-tiny", "TASK_STATUS_QUEUED")] == 1
    assert "WORKER" in (await cli("admin", "stats")).out
    assert (await cli("admin", "stuck", "--json")).json() == {"tasks": []}
    requeue = await cli("admin", "requeue", task["task_id"], "--dry-run", "--json")
    assert requeue.code == 0, requeue.err
    items = [item for batch in requeue.lines() for item in batch["items"]]
    assert [i["task_id"] for i in items] == [task["task_id"]]
    assert (await cli("admin", "requeue")).code == 2
    repair = await cli("admin", "repair", "--dry-run", "--json")
    assert repair.code == 0 and repair.json()["stuck"] == 0
    assert (await cli("admin", "dead-letters", "--json")).json() == {"dead_letters": []}
    assert (await cli("admin", "redeliver", task["task_id"], "--json")).json() == {"deliveries": []}
    assert (await cli("admin", "deliveries", "--status", "failed", "--json")).json() == {"deliveries": []}
    rotated = await cli("admin", "rotate-secret", "--tenant", "tenant-a", "--overlap", "1h", "--json")
    assert rotated.code == 0 and rotated.json()["valid_secrets"] == 2, rotated.err
    keys = (await cli("admin", "keys", "--tenant", "tenant-a", "--json")).json()["keys"]
    assert len(keys) == 1 and keys[0]["tenant"] == "tenant-a"
    assert (await cli("admin", "rotate-secret", "--tenant", "nobody")).code == 3
    usage = await cli("admin", "usage", "--since", "7d", "--json")  # nothing ran here: no metered use, the range read
    assert usage.code == 0 and usage.json().get("rows", []) == [] and "since" in usage.json(), usage.err
    assert "no metered use" in (await cli("admin", "usage", "--tenant", "tenant-a", "--by-hour")).out
    assert (await cli("admin", "usage", "--since", "soon")).code == 2
    one = await cli("admin", "usage", "--tenant", "tenant-a", "--end-user", "ann", "--json")
    assert one.code == 0 and one.json().get("rows", []) == [], one.err
    assert "no metered use" in (await cli("admin", "usage", "--tenant", "tenant-a", "--by-end-user")).out
    assert (await cli("admin", "usage", "--end-user", "ann")).code == 2  # an end user is a tenant's own


async def test_defaults_come_from_the_saved_local_stack(cli: Cli, tmp_path: Path) -> None:
    env = cli.env
    LocalStack(
        address=env["TASKGATE_ADDRESS"],
        events_address=env["TASKGATE_EVENTS_ADDRESS"],
        admin_address=env["TASKGATE_ADMIN_ADDRESS"],
        worker_address="127.0.0.1:1",
        api_key=env["TASKGATE_API_KEY"],
        admin_key=env["TASKGATE_ADMIN_KEY"],
        tenant="tenant-a",
    ).save(tmp_path / ".taskgate")
    names = (
        "TASKGATE_ADDRESS",
        "TASKGATE_EVENTS_ADDRESS",
        "TASKGATE_ADMIN_ADDRESS",
        "TASKGATE_API_KEY",
        "TASKGATE_ADMIN_KEY",
    )
    bare = dict.fromkeys(names, "")
    bare["TASKGATE_STATE_DIR"] = ".taskgate"
    sub = tmp_path / "some" / "folder"
    sub.mkdir(parents=True)
    listed = await cli("list", "--json", env=bare, cwd=sub)  # found by walking up from the working directory
    assert listed.code == 0, listed.err
    assert (await cli("admin", "stats", env=bare, cwd=sub)).code == 0


async def test_upload_and_submit_an_image_to_video_task(cli: Cli, tmp_path: Path) -> None:
    picture = tmp_path / "cat.jpg"
    Image.new("RGB", (40, 24), (120, 80, 40)).save(picture, format="JPEG")
    uploaded = await cli("upload", str(picture), "--json")
    assert uploaded.code == 0, uploaded.err
    image = uploaded.json()
    assert (image["width"], image["height"], image["source_format"]) == (40, 24, "JPEG")
    done = await cli("submit", "the cat turns", "--model", "sleepy-i2v", "--image", str(picture), "--wait", "--json")
    assert done.code == 0, done.err
    task = done.lines()[-1]
    assert (
        task["status"] == "SUCCEEDED"
        and task["task_type"] == "image-to-video"
        and task["image"]["sha256"] == image["sha256"]
    )
    # the worker ran from the stored image (the sleep model's output names what it read)
    fetched = await cli("result", task["task_id"], "-o", str(tmp_path / "out.json"))
    assert fetched.code == 0, fetched.err
    assert json.loads((tmp_path / "out.json").read_bytes())["image_sha256"] == image["sha256"]
    missing = await cli("submit", "x", "--model", "sleepy-i2v", "--image", str(tmp_path / "nope.png"))
    assert missing.code == 2 and "no such image file" in missing.err


def test_every_command_accepts_json_before_or_after() -> None:
    parser = build_parser()
    assert parser.parse_args(["--json", "get", "1"]).json is True
    assert parser.parse_args(["get", "1", "--json"]).json is True
    assert parser.parse_args(["admin", "stats", "--json"]).json is True
    assert keys.build_parser().parse_args(["list", "--json"]).json is True
    assert keys.build_parser().parse_args(["--json", "list"]).json is True
    with pytest.raises(SystemExit):
        parser.parse_args(["keys", "list"])  # server-side now: `taskgate-keys`
    assert not hasattr(parser.parse_args(["get", "1"]), "json")  # filled in by main()


async def _succeeded(cli: Cli, task_id: str) -> bool:
    return bool(await cli.backends.pool.fetchval("SELECT status = 'SUCCEEDED' FROM task WHERE id = $1", int(task_id)))


async def test_admin_requeue_replays_a_dead_letter_and_exits_13_when_it_skipped_any(cli: Cli) -> None:
    pool = cli.backends.pool
    source = await dead(pool, ServerStatus.FAILED, model_id="sleepy")
    done = await put_in(pool, ServerStatus.SUCCEEDED, model_id="sleepy")
    plain = await cli("admin", "requeue", str(source.id), "--json")
    assert plain.code == EXIT_SKIPPED == 13
    [item] = [i for batch in plain.lines() for i in batch["items"]]
    assert item["action"] == "SKIPPED" and "--replay-finished" in item["detail"]
    [line] = plain.err.splitlines()
    assert line.startswith("error: SKIPPED: 1 of 1 task(s)") and "hint:" in line and "--replay-finished" in line
    tasks = await pool.fetchval("SELECT count(*) FROM task")

    dry = await cli("admin", "requeue", str(source.id), "--replay-finished", "--dry-run", "--json")

    assert (dry.code, dry.err) == (0, "")
    assert [i["action"] for batch in dry.lines() for i in batch["items"]] == ["WOULD_REPLAY"]
    assert await pool.fetchval("SELECT count(*) FROM task") == tasks

    replayed = await cli("admin", "requeue", str(source.id), str(done.id), "--replay-finished")

    assert replayed.code == 13 and "1 of 2 task(s)" in replayed.err  # the SUCCEEDED one is never replayed
    assert "never replayed" in replayed.out
    [new_id] = re.findall(r"REPLAYED\s+as task (\d+)", replayed.out)
    await wait_for(lambda: _succeeded(cli, new_id), within=30)
    got = await cli("get", new_id, "--json")
    assert got.json()["replay_of"] == str(source.id) and got.json()["params"]["seed"] == source.request_payload["seed"]
    letters = (await cli("admin", "dead-letters", "--json")).json()["dead_letters"]
    assert [(d["task"]["id"], d["replayed_as"]) for d in letters] == [(str(source.id), new_id)]
    assert new_id in (await cli("admin", "dead-letters")).out
    again = await cli("admin", "requeue", str(source.id), "--replay-finished", "--json")
    assert again.code == 13 and f"already replayed as task {new_id}" in again.out

"""The command-line contract both of taskgate's commands keep, `taskgate` (taskgate_client.cli) and `taskgate-keys`
(taskgate.keys): the exit codes scripts rely on, one error line with a hint, `--json` documents, ages such as `90m`,
and where the local stack's state folder is. Here so that neither command's package imports the other's.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message

from taskgate_api.status import Status

EXIT_CODES = """Exit codes (a contract for scripts):
  0 success                 1 other error (INTERNAL, UNKNOWN, ...)      2 usage error
  3 NOT_FOUND               4 INVALID_ARGUMENT                          5 RESOURCE_EXHAUSTED
  6 UNAUTHENTICATED         7 PERMISSION_DENIED                         8 FAILED_PRECONDITION
  9 ALREADY_EXISTS          10 UNAVAILABLE (service or database down)   11 DEADLINE_EXCEEDED / --wait timed out
  12 DATA_LOSS (download checksum mismatch)
  20 task FAILED            21 task TIMEOUT                              22 task CANCELED   (submit --wait, wait)
  130 interrupted (Ctrl-C)
"""  # both commands' --help ends with it

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 10
EXIT_TIMEOUT = 11
EXIT_INTERRUPTED = 130
EXIT_BY_CODE: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.NOT_FOUND: 3,
    grpc.StatusCode.INVALID_ARGUMENT: 4,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 5,
    grpc.StatusCode.UNAUTHENTICATED: 6,
    grpc.StatusCode.PERMISSION_DENIED: 7,
    grpc.StatusCode.FAILED_PRECONDITION: 8,
    grpc.StatusCode.ALREADY_EXISTS: 9,
    grpc.StatusCode.UNAVAILABLE: EXIT_UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: EXIT_TIMEOUT,
    grpc.StatusCode.DATA_LOSS: 12,
}
EXIT_BY_STATUS: dict[Status, int] = {Status.SUCCEEDED: 0, Status.FAILED: 20, Status.TIMEOUT: 21, Status.CANCELED: 22}


class CliError(Exception):
    """A failure outside gRPC (usage, configuration) with the exit code to use."""

    def __init__(self, message: str, exit_code: int = EXIT_ERROR, hint: str = "") -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.hint = hint


class Output:
    """Where results go: one JSON document (or JSON lines for streams) with --json, readable text otherwise."""

    def __init__(self, as_json: bool, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> None:
        self.json = as_json
        self.out = out
        self.err = err

    def document(self, data: object) -> None:
        self.out.write(json.dumps(data, default=_json_default) + "\n")
        self.out.flush()

    def line(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def table(self, headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
        cells = [[str(c) for c in headers], *[[cell(c) for c in row] for row in rows]]
        widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
        for row in cells:
            self.line("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())

    def listing(
        self,
        key: str,
        items: Sequence[Message],
        empty: str,
        headers: Sequence[str],
        row: Callable[[Any], Sequence[object]],
    ) -> int:
        """A list of messages: `{key: [...]}` with --json, else a table (or `empty` when there is nothing)."""
        if self.json:
            self.document({key: [proto_dict(item) for item in items]})
        elif not items:
            self.line(empty)
        else:
            self.table(headers, [row(item) for item in items])
        return EXIT_OK

    def fields(self, pairs: Sequence[tuple[str, object]]) -> None:
        width = max(len(k) for k, _ in pairs)
        for key, value in pairs:
            if value not in (None, ""):
                self.line(f"{key.ljust(width)}  {cell(value)}")


def _json_default(value: object) -> object:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Message):
        return proto_dict(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def proto_dict(msg: Message) -> dict[str, Any]:
    """A message as --json prints it: proto field names, every field present."""
    return json_format.MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def cell(value: object) -> str:
    """A value as a table cell: local time for datetimes, a state's name."""
    if isinstance(value, datetime):
        return value.astimezone().strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(value, Status):
        return value.value
    return str(value)


def report_cli_error(out: Output, exc: CliError) -> int:
    """Prints one line with the message and its hint; returns the exit code."""
    out.err.write(f"error: {exc}" + (f" — hint: {exc.hint}" if exc.hint else "") + "\n")
    if out.json:
        out.document({"error": {"code": "CLI", "message": str(exc), "hint": exc.hint}})
    return exc.exit_code


AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def age(text: str) -> float:
    """A duration argument (argparse `type=`): seconds, or a number with s, m, h or d (`90m`, `12h`, `30d`)."""
    unit = AGE_UNITS.get(text[-1:].lower())
    try:
        value = float(text[:-1] if unit else text) * (unit or 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an age such as 3600, 90m, 12h or 30d") from None
    if value < 0:
        raise argparse.ArgumentTypeError("an age is not negative")
    return value


def find_state_dir(state_dir: Path, start: Path | None = None, *, marker: str) -> Path:
    """`state_dir` if absolute or holding `marker`; else the nearest parent of `start` (cwd) where it does.

    So a command finds the local stack's details from any subfolder of the checkout.
    """
    if state_dir.is_absolute() or (state_dir / marker).exists():
        return state_dir
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / state_dir / marker).exists():
            return folder / state_dir
    return state_dir

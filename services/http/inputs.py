"""What the HTTP face reads from a request, in one place: JSON bodies within a depth bound, integers from headers and
query strings, task states by name. Every route goes through these, so a bad input is a 400 naming its field, never a
500."""

from __future__ import annotations

import json
import re
from typing import Any

from taskgate_api.v1 import task_pb2

_ASCII_DIGITS = re.compile(r"[0-9]{1,19}")


class BadInput(ValueError):
    """An input a route refuses; `field` is what the answer names."""

    def __init__(self, field: str, description: str) -> None:
        super().__init__(description)
        self.field = field
        self.description = description


def depth(value: Any, limit: int) -> int:
    """How deep `value` (parsed JSON) nests arrays and objects, counted up to `limit + 1` (no further): one level of
    containers at a time, without recursion."""
    level, frontier = 0, [value]
    while level <= limit:
        frontier = [item for item in frontier if isinstance(item, (dict, list))]
        if not frontier:
            break
        level += 1
        frontier = [child for item in frontier for child in (item.values() if isinstance(item, dict) else item)]
    return level


def json_body(raw: bytes, max_depth: int, field: str = "body") -> Any:
    """`raw` parsed as JSON, refused (BadInput on `field`) when it is not JSON or nests deeper than `max_depth`.

    The C parser guards its own recursion (a RecursionError, caught here, for `[` * 100,000); what it accepts is then
    measured, so what reaches a route (protobuf's ParseDict, a handler) is never deeper than `max_depth`."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise BadInput(field, f"nested deeper than {max_depth} levels") from None
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError included
        raise BadInput(field, f"not valid JSON: {exc}") from None
    if depth(data, max_depth) > max_depth:
        raise BadInput(field, f"nested deeper than {max_depth} levels")
    return data


def integer(value: str, field: str, *, low: int = 0, high: int = 2**63 - 1) -> int:
    """A decimal integer of ASCII digits within [low, high], as a header or query value must spell it (`str.isdigit`
    and `int` also take '²' and '٣', and `int` takes ' 1' and '1_0')."""
    if _ASCII_DIGITS.fullmatch(value) is None:
        raise BadInput(field, "must be a non-negative integer in ASCII digits")
    number = int(value)
    if not low <= number <= high:
        raise BadInput(field, f"must be between {low} and {high}")
    return number


def status_value(name: str) -> int | None:
    """A TaskStatus by name, with or without its TASK_STATUS_ prefix, any case."""
    key = name.strip().upper()
    key = key if key.startswith("TASK_STATUS_") else f"TASK_STATUS_{key}"
    known = set(task_pb2.TaskStatus.keys()) - {"TASK_STATUS_UNSPECIFIED"}
    return task_pb2.TaskStatus.Value(key) if key in known else None

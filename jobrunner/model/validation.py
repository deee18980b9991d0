"""Input checks shared by the CLI, the local runner and the operator.

Everything is validated before anything is written, so bad input loses nothing and
leaves nothing half-done.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from jobrunner.model.errors import BadInput

MAX_PAYLOAD_BYTES = 1024 * 1024  # 1 MiB of JSON per task: queue rows are not blob storage
MAX_KEY_CHARS = 512
MAX_ID_CHARS = 256
MAX_ATTEMPTS_LIMIT = 1000
MAX_LIMITS_PER_TASK = 16
MAX_TOKENS = 10**15  # a token estimate or report past this is a bug, not a workload
# The key of a batch's reduce task (jobrunner/features/reduce.py): no task of a batch may use it.
REDUCE_KEY = "__reduce__"
# The key of a batch's generator task (jobrunner/features/generators.py): reserved the same way.
GENERATE_KEY = "__generate__"
RESERVED_KEYS = {REDUCE_KEY: "the batch's reduce step", GENERATE_KEY: "the batch's generator"}


@dataclass(frozen=True)
class TaskSpec:
    key: str
    payload: dict[str, Any] = field(default_factory=dict)
    shard_key: str | None = None
    max_attempts: int | None = None
    limits: tuple[str, ...] | None = None  # flow-control limits it draws from (by name)
    tokens: int | None = None  # its token estimate, charged to token limits at the claim


def check_identifier(value: Any, what: str, *, max_chars: int = MAX_ID_CHARS,
                     allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise BadInput(f"{what} must be a string, got {type(value).__name__}")
    if not value and not allow_empty:
        raise BadInput(f"{what} must not be empty")
    if "\x00" in value:
        raise BadInput(f"{what} contains a NUL byte, which PostgreSQL text cannot store")
    if len(value) > max_chars:
        raise BadInput(f"{what} is {len(value)} characters long; the limit is {max_chars}")
    return value


def check_max_attempts(value: Any, what: str = "max_attempts") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadInput(f"{what} must be an integer, got {value!r}")
    if not 1 <= value <= MAX_ATTEMPTS_LIMIT:
        raise BadInput(f"{what} must be between 1 and {MAX_ATTEMPTS_LIMIT}, got {value}")
    return value


def encode_payload(payload: Any, what: str = "payload") -> str:
    if not isinstance(payload, dict):
        raise BadInput(f"{what} must be a JSON object, got {json_type(payload)}")
    try:
        text = json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise BadInput(f"{what} is not JSON-serialisable: {exc}") from None
    if "\\u0000" in text:
        raise BadInput(f"{what} contains a NUL character (\\u0000), which jsonb cannot store")
    size = len(text.encode())
    if size > MAX_PAYLOAD_BYTES:
        raise BadInput(f"{what} is {size} bytes of JSON; the limit is {MAX_PAYLOAD_BYTES} bytes")
    return text


def json_type(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            int: "a number", float: "a number", type(None): "null"}.get(type(value), "a value")


def task_from_obj(obj: Any, where: str) -> TaskSpec:
    if not isinstance(obj, dict):
        raise BadInput(f"{where}: a task must be a JSON object, got {json_type(obj)}")
    unknown = set(obj) - {"key", "shard_key", "payload", "max_attempts", "limits", "tokens"}
    if unknown:
        raise BadInput(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    if "key" not in obj:
        raise BadInput(f"{where}: missing required field 'key'")
    key = check_identifier(obj["key"], f"{where}: key", max_chars=MAX_KEY_CHARS)
    shard = obj.get("shard_key")
    if shard is not None:
        shard = check_identifier(shard, f"{where}: shard_key", max_chars=MAX_KEY_CHARS,
                                 allow_empty=True) or None
    payload = obj.get("payload", {})
    encode_payload(payload, f"{where}: payload")
    attempts = obj.get("max_attempts")
    if attempts is not None:
        attempts = check_max_attempts(attempts, f"{where}: max_attempts")
    limits = check_limit_names(obj["limits"], f"{where}: limits") if "limits" in obj else None
    tokens = check_tokens(obj["tokens"], f"{where}: tokens") if "tokens" in obj else None
    return TaskSpec(key=key, payload=payload, shard_key=shard, max_attempts=attempts,
                    limits=limits, tokens=tokens)


def check_limit_names(value: Any, what: str = "limits") -> tuple[str, ...] | None:
    """A list of limit names (deduplicated, in order); an empty list or None: none.
    Whether the limits exist is checked against the database when enqueueing."""
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise BadInput(f"{what} must be a list of limit names, got {json_type(value)}")
    names: list[str] = []
    for item in value:
        name = check_identifier(item, f"{what}: limit name", max_chars=MAX_ID_CHARS)
        if name not in names:
            names.append(name)
    if len(names) > MAX_LIMITS_PER_TASK:
        raise BadInput(f"{what}: {len(names)} limits; a task may name at most "
                       f"{MAX_LIMITS_PER_TASK}")
    return tuple(names) or None


def check_tokens(value: Any, what: str = "tokens") -> int:
    """A token count (an estimate, a report): a whole number, 0 or more."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadInput(f"{what} must be a whole number of tokens, got {value!r}")
    if not 0 <= value <= MAX_TOKENS:
        raise BadInput(f"{what} must be between 0 and {MAX_TOKENS}, got {value}")
    return value


def parse_jsonl(lines: Iterable[str], source: str = "input", *,
                to_task: Callable[[Any, str], TaskSpec] = task_from_obj,
                key_name: str = "key") -> list[TaskSpec]:
    """Parse JSON lines into task specs; any bad line rejects the whole input. Each
    decoded line becomes a task through `to_task` (another input format plugs in its
    own, e.g. jobrunner.openai_batch); `key_name` is what error messages call the key."""
    tasks: list[TaskSpec] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{source} line {number}"
        try:
            obj = json.loads(line.rstrip("\r\n"), parse_constant=_reject_constant)
        except json.JSONDecodeError as exc:
            raise BadInput(f"{where}: malformed JSON ({exc.msg} at column {exc.colno})") from None
        except ValueError as exc:
            raise BadInput(f"{where}: {exc}") from None
        task = to_task(obj, where)
        if task.key in seen:
            raise BadInput(f"{where}: duplicate {key_name} {task.key!r} (first seen on line "
                           f"{seen[task.key]})")
        seen[task.key] = number
        tasks.append(task)
    return tasks


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def check_positive_seconds(value: float, what: str, *, maximum: float = 7 * 86400) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or math.isnan(value):
        raise BadInput(f"{what} must be a number")
    if not 0 < value <= maximum:
        raise BadInput(f"{what} must be greater than 0 and at most {maximum:g}, got {value:g}")
    return float(value)


# A step's handler, as the CRDs' pattern has it (module:function).
HANDLER_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_.]*")


def parse_step(raw: Any, at: str, fields: tuple[str, ...], what: str
               ) -> tuple[str | None, list[str] | None]:
    """A step of a BatchRun that runs user code (spec.reduce, spec.source.generator):
    a mapping of `fields` with exactly one of handler (module:function) or command (a
    list of strings, or one string run by /bin/sh -c). Returns (handler, command)."""
    if not isinstance(raw, Mapping):
        raise BadInput(f"{at} must be a mapping with handler or command, and {what}")
    unknown = set(raw) - set(fields)
    if unknown:
        raise BadInput(f"{at}: unknown field(s) {', '.join(sorted(map(str, unknown)))} "
                       f"({', '.join(fields)})")
    handler, command = raw.get("handler"), raw.get("command")
    if (handler is None) == (command is None):
        raise BadInput(f"{at}: exactly one of handler (module:function) or command must be set")
    if handler is not None and (not isinstance(handler, str)
                                or not HANDLER_PATTERN.fullmatch(handler)):
        raise BadInput(f"{at}.handler must look like 'package.module:function', got "
                       f"{handler!r}")
    if command is not None:
        if isinstance(command, str):
            command = ["/bin/sh", "-c", command]
        if not isinstance(command, list) or not command or not all(
                isinstance(c, str) and c for c in command):
            raise BadInput(f"{at}.command must be a non-empty list of strings")
    return handler, command

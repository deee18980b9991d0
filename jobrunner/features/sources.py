"""JSON-lines sources of a BatchRun's tasks: `source.configMap` (read by the controller,
or by `jobrunner run` from a ConfigMap in the manifest's own file) and `source.file`
(`jobrunner run` only, relative to the manifest). The lines are those of
`jobrunner enqueue`; every line is validated before anything is written, and an error
names the line (docs/sources.md)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jobrunner.model.errors import BadInput
from jobrunner.model.validation import TaskSpec, check_identifier, parse_jsonl

MAX_FILE_BYTES = 512 * 1024 * 1024  # a local file; a ConfigMap is capped at 1 MiB anyway


def parse_lines(text: str, source: str) -> tuple[TaskSpec, ...]:
    """Every line checked (JSON, fields, sizes, duplicate keys) before anything is
    written; an empty source is refused (a batch with no task never completes)."""
    tasks = parse_jsonl(text.splitlines(), source)
    if not tasks:
        raise BadInput(f"{source}: no tasks (expected one JSON object per line, as for "
                       "`jobrunner enqueue`)")
    return tuple(tasks)


def parse_config_map_ref(raw: Any, where: str) -> tuple[str, str]:
    at = f"{where}: spec.source.configMap"
    if not isinstance(raw, Mapping):
        raise BadInput(f"{at} must be a mapping with name and key")
    unknown = set(raw) - {"name", "key"}
    if unknown:
        raise BadInput(f"{at}: unknown field(s) {', '.join(sorted(map(str, unknown)))} "
                       "(name, key)")
    for field in ("name", "key"):
        if not isinstance(raw.get(field), str) or not raw[field]:
            raise BadInput(f"{at}.{field} is required (a non-empty string)")
    return check_identifier(raw["name"], f"{at}.name", max_chars=253), check_identifier(
        raw["key"], f"{at}.key", max_chars=253)


def config_map_tasks(obj: Mapping[str, Any], name: str, key: str, where: str
                     ) -> tuple[TaskSpec, ...]:
    """The tasks in key `key` of a ConfigMap (its `data`, as the API returns it)."""
    data = obj.get("data") or {}
    if key not in data:
        binary = key in (obj.get("binaryData") or {})
        raise BadInput(f"{where}: ConfigMap {name} has no key {key!r} in data"
                       + (" (it is in binaryData: put the JSON lines in data)" if binary
                          else f" (its keys: {', '.join(sorted(data)) or 'none'})"))
    text = data[key]
    if not isinstance(text, str):
        raise BadInput(f"{where}: ConfigMap {name} key {key!r} must be text")
    return parse_lines(text, f"ConfigMap {name} key {key}")


def file_tasks(raw: Any, where: str, base_dir: Path | None) -> tuple[TaskSpec, ...]:
    at = f"{where}: spec.source.file"
    if not isinstance(raw, str) or not raw:
        raise BadInput(f"{at} must be a path (relative to the manifest)")
    if base_dir is None:
        raise BadInput(f"{at}: a file is read by `jobrunner run` only (relative to the "
                       "manifest); on a cluster use source.configMap")
    path = Path(raw)
    path = path if path.is_absolute() else base_dir / path
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise BadInput(f"{at}: {path} is {size:,} bytes; the limit is {MAX_FILE_BYTES:,} "
                           "(enqueue a larger input with `jobrunner enqueue` and source "
                           "external)")
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise BadInput(f"{at}: cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise BadInput(f"{at}: {path} is not UTF-8 text ({exc.reason} at byte "
                       f"{exc.start})") from None
    return parse_lines(text, str(raw))

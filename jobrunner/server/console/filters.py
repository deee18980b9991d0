"""The task browser's filter: a state, a key prefix, payload fields, a shard key, a least
number of attempts and text of the last error, read from the page's query string and
handed to the store as bound parameters only.

A payload filter is `payload.<field>[.<field>...] = <value>`, several joined by `and`
(`payload.doc = "csv" and payload.lang = en`). The value is JSON (`"csv"`, `3`, `true`,
`null`, `{"a": 1}`) or a bare word, taken as a string. The terms become one JSON
document the payload must contain (`payload @> %(contains)s`): the filter never reaches
the SQL text, and a field path is only ever a key of that document."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

STATES = ("pending", "leased", "done", "dead", "cancelled")
_TERM = re.compile(r"^payload((?:\.[A-Za-z0-9_\-]+)+)\s*=\s*(.+)$", re.DOTALL)
_AND = re.compile(r"\s+and\s+", re.IGNORECASE)
_BARE = re.compile(r"^[^\s\"'{}\[\],]+$")
MAX_FILTER_CHARS = 1000


class FilterError(ValueError):
    """A filter the browser cannot read; its message is shown on the page."""


def parse_payload(text: str) -> dict[str, Any] | None:
    """The JSON document a payload must contain for `text`; None for an empty filter."""
    text = text.strip()
    if not text:
        return None
    if len(text) > MAX_FILTER_CHARS:
        raise FilterError(f"the payload filter is over {MAX_FILTER_CHARS} characters")
    document: dict[str, Any] = {}
    for term in _AND.split(text):
        match = _TERM.match(term.strip())
        if not match:
            raise FilterError(f"cannot read {term.strip()!r}: write payload.field = value, "
                              "e.g. payload.doc = \"csv\"")
        path = match[1].lstrip(".").split(".")
        raw = match[2].strip()
        try:
            value = json.loads(raw)
        except ValueError:
            if not _BARE.match(raw):
                raise FilterError(f"cannot read the value {raw!r}: JSON (\"text\", 3, true) "
                                  "or one bare word") from None
            value = raw
        node = document
        for name in path[:-1]:
            child = node.setdefault(name, {})
            if not isinstance(child, dict):
                raise FilterError(f"payload.{'.'.join(path)} conflicts with another term")
            node = child
        if path[-1] in node:
            raise FilterError(f"payload.{'.'.join(path)} is given twice")
        node[path[-1]] = value
    return document


def _text(params: Any, name: str, what: str) -> str:
    value = params.get(name) or ""
    if len(value) > MAX_FILTER_CHARS or "\x00" in value:
        raise FilterError(f"the {what} is too long or holds a NUL byte")
    return value


@dataclass(frozen=True)
class TaskFilter:
    state: str | None = None
    prefix: str = ""
    payload: str = ""
    shard: str = ""  # exactly this shard key
    attempts: int | None = None  # at least this many attempts
    error: str = ""  # text the last error contains, in any case

    @classmethod
    def from_params(cls, params: Any) -> TaskFilter:
        state = (params.get("state") or "").strip() or None
        if state is not None and state not in STATES:
            raise FilterError(f"unknown state {state!r}: one of {', '.join(STATES)}")
        attempts_text = (params.get("attempts") or "").strip()
        attempts = None
        if attempts_text:
            if not attempts_text.isdigit() or int(attempts_text) > 1_000_000:
                raise FilterError(f"attempts must be a whole number from 0, got "
                                  f"{attempts_text[:40]!r}")
            attempts = int(attempts_text)
        found = cls(state, _text(params, "prefix", "key prefix"),
                    (params.get("payload") or "").strip(), _text(params, "shard", "shard key"),
                    attempts, _text(params, "error", "error text").strip())
        found.contains()  # (a bad payload filter is refused here, once)
        return found

    def narrow(self) -> dict[str, Any]:
        """The shard, attempts and error filters as the store's statements take them."""
        return {"shard": self.shard or None, "min_attempts": self.attempts,
                "error": self.error or None}

    def contains(self) -> dict[str, Any] | None:
        return parse_payload(self.payload)

    def contains_json(self) -> str | None:
        document = self.contains()
        return json.dumps(document) if document is not None else None

    def params(self, **extra: Any) -> dict[str, str]:
        found = {"state": self.state or "", "prefix": self.prefix, "payload": self.payload,
                 "shard": self.shard, "error": self.error,
                 "attempts": "" if self.attempts is None else str(self.attempts)}
        found.update({k: str(v) for k, v in extra.items() if v is not None})
        return {k: v for k, v in found.items() if v}

    def query(self, **extra: Any) -> str:
        return urlencode(self.params(**extra))

    def describe(self) -> str:
        parts = [f"state = {self.state}"] if self.state else []
        if self.prefix:
            parts.append(f"key starts with {self.prefix!r}")
        if self.payload:
            parts.append(self.payload)
        if self.shard:
            parts.append(f"shard = {self.shard!r}")
        if self.attempts is not None:
            parts.append(f"at least {self.attempts} attempts")
        if self.error:
            parts.append(f"error contains {self.error!r}")
        return "; ".join(parts) or "every task"

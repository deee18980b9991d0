"""Keep DSN passwords out of every log line, Event, status field and error message."""

from __future__ import annotations

import re

from psycopg.conninfo import conninfo_to_dict, make_conninfo

_URL_PASSWORD = re.compile(r"(?P<head>postgres(?:ql)?://[^:/@\s]*:)(?P<pw>[^@\s]*)(?P<tail>@)")
_KV_PASSWORD = re.compile(r"(?P<head>\bpassword\s*=\s*)(?P<pw>'(?:[^'\\]|\\.)*'|\S+)", re.I)


def redact_dsn(dsn: str) -> str:
    """Return the DSN with any password replaced by ``***``."""
    try:
        params = conninfo_to_dict(dsn)
    except Exception:
        return redact_text(dsn)
    if "password" in params:
        params["password"] = "***"
    return make_conninfo(**{k: v for k, v in params.items() if v is not None})


def redact_text(text: str, *secrets: str | None) -> str:
    """Mask DSN-shaped passwords and any of the given secret strings in free text."""
    text = _URL_PASSWORD.sub(lambda m: f"{m['head']}***{m['tail']}", text)
    text = _KV_PASSWORD.sub(lambda m: f"{m['head']}***", text)
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return text


def dsn_password(dsn: str) -> str | None:
    try:
        return conninfo_to_dict(dsn).get("password")
    except Exception:
        return None

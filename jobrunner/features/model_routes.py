"""The model routing table of the Batch API (docs/batch-api.md): which upstream serves a
request, chosen by the `model` of its body.

A YAML (or JSON) file, named by JOBRUNNER_MODEL_ROUTES in the server (which refuses a
batch for a model it does not list) and in the workers (whose handler,
jobrunner.openai_batch:handle, sends each request where its model says):

    models:
      llama-3.1-8b:
        base_url: http://vllm.models:8000/v1
        api_key_env: VLLM_API_KEY      # the environment variable holding the key (a Secret)
        upstream_model: meta-llama/Llama-3.1-8B-Instruct   # optional: the name upstream
        limit: vllm                    # optional: the flow-control limit a 429 blocks
        timeout: 600                   # optional: seconds per request
        input_cost_per_token: 0.0000001   # optional: cost reported per request
        output_cost_per_token: 0.0000002

The key itself is never in the file, only the name of the variable that holds it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from decimal import Decimal
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from jobrunner.model.errors import BadInput

ROUTES_ENV = "JOBRUNNER_MODEL_ROUTES"
_FIELDS = {"base_url", "api_key_env", "upstream_model", "limit", "timeout",
           "input_cost_per_token", "output_cost_per_token"}


@dataclass(frozen=True)
class Route:
    model: str
    base_url: str
    api_key_env: str | None = None
    upstream_model: str | None = None
    limit: str | None = None
    timeout: float | None = None
    input_cost_per_token: Decimal = Decimal(0)
    output_cost_per_token: Decimal = Decimal(0)

    def cost(self, input_tokens: int, output_tokens: int) -> Decimal:
        return input_tokens * self.input_cost_per_token + output_tokens * self.output_cost_per_token


def parse(data: Any, source: str) -> dict[str, Route]:
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, dict) or not models:
        raise BadInput(f"{source}: expected a mapping `models: {{NAME: {{base_url: ...}}}}`")
    routes = {}
    for name, spec in models.items():
        where = f"{source}: model {name!r}"
        if not isinstance(spec, dict) or not isinstance(spec.get("base_url"), str):
            raise BadInput(f"{where}: needs a base_url")
        unknown = set(spec) - _FIELDS
        if unknown:
            raise BadInput(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
        try:
            routes[str(name)] = Route(
                model=str(name), base_url=spec["base_url"].rstrip("/"),
                api_key_env=spec.get("api_key_env"), upstream_model=spec.get("upstream_model"),
                limit=spec.get("limit"),
                timeout=float(spec["timeout"]) if spec.get("timeout") is not None else None,
                input_cost_per_token=Decimal(str(spec.get("input_cost_per_token", 0))),
                output_cost_per_token=Decimal(str(spec.get("output_cost_per_token", 0))))
        except (ArithmeticError, ValueError, TypeError) as exc:
            raise BadInput(f"{where}: {exc}") from None
    return routes


@cache
def _load(path: str, mtime: float) -> dict[str, Route]:
    text = Path(path).read_text()
    data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    return parse(data, path)


def load(path: str | None = None) -> dict[str, Route] | None:
    """The table from `path` (default: $JOBRUNNER_MODEL_ROUTES), re-read when the file
    changes (a ConfigMap update); None when none is configured."""
    path = path or os.environ.get(ROUTES_ENV)
    if not path:
        return None
    return _load(path, os.stat(path).st_mtime)

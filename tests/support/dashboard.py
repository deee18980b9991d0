"""The chart's Grafana dashboard (charts/jobrunner/files/dashboard.json) as the tests use
it: its rows and panels, each panel's queries with Grafana's variables filled in as a
dashboard showing every batch and tenant would fill them, and the panels drawn with
matplotlib from a Prometheus's answers to those very queries (the PNGs of
docs/observability.md: `python hack/dashboard_pngs.py`)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent.parent
DASHBOARD = REPO / "charts/jobrunner/files/dashboard.json"


@dataclass(frozen=True)
class Query:
    ref: str
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    row: str
    title: str
    kind: str
    unit: str
    queries: tuple[Query, ...]


def load(path: Path = DASHBOARD) -> dict[str, Any]:
    return json.loads(path.read_text())


def panels(dashboard: dict[str, Any]) -> list[Panel]:
    out: list[Panel] = []
    row = ""
    for p in dashboard["panels"]:
        if p["type"] == "row":
            row = p["title"]
            continue
        out.append(Panel(row, p["title"], p["type"],
                         p.get("fieldConfig", {}).get("defaults", {}).get("unit", ""),
                         tuple(Query(t["refId"], t["expr"], t.get("legendFormat", ""))
                               for t in p["targets"])))
    return out


def fill(expr: str, *, rate_interval: str, range_: str) -> str:
    """The query as Grafana sends it with every batch and tenant selected ("All": the
    variables' allValue) and the given $__rate_interval and $__range."""
    out = expr.replace("$__rate_interval", rate_interval).replace("$__range", range_)
    return re.sub(r"\$(batch|tenant)\b", ".*", out)


def legend(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template) or \
        ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def render(answers: dict[tuple[str, str], list[dict[str, Any]]], out_dir: Path,
           dashboard: dict[str, Any]) -> list[Path]:
    """One PNG per row of the dashboard, each panel a subplot drawn from `answers`:
    (panel title, refId) -> the query_range result of that panel's query."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    by_row: dict[str, list[Panel]] = {}
    for panel in panels(dashboard):
        by_row.setdefault(panel.row, []).append(panel)
    written = []
    for row, row_panels in by_row.items():
        fig, axes = plt.subplots(1, len(row_panels), figsize=(4.2 * len(row_panels), 3.4),
                                 squeeze=False)
        for ax, panel in zip(axes[0], row_panels, strict=True):
            lanes: list[str] = []
            for q in panel.queries:
                for series in answers[(panel.title, q.ref)]:
                    xs = [datetime.fromtimestamp(float(t), tz=UTC)
                          for t, _ in series["values"]]
                    ys = [float(v) for _, v in series["values"]]
                    name = legend(q.legend, series["metric"])[:40]
                    if panel.kind == "state-timeline":
                        # (as Grafana draws it: a lane per series, marked while it holds)
                        ax.scatter(xs, [len(lanes)] * len(xs), marker="s", s=12)
                        lanes.append(name)
                    else:
                        ax.plot(xs, ys, label=name)
            ax.set_title(panel.title, fontsize=9)
            ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
            ax.tick_params(labelsize=7)
            if lanes:
                ax.set_yticks(range(len(lanes)), lanes, fontsize=6)
                ax.set_ylim(-0.5, len(lanes) - 0.5)
                continue
            if panel.unit:
                ax.set_ylabel(panel.unit, fontsize=7)
            ax.legend(fontsize=6, loc="best")
        fig.suptitle(f"jobrunner dashboard: {row}", fontsize=10)
        fig.tight_layout()
        path = out_dir / f"dashboard-{re.sub(r'[^a-z]+', '-', row.lower()).strip('-')}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written

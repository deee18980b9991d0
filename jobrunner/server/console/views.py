"""The console's routes under /console: pages (overview, batch, task browser, task,
dead list, audit), the live updates' event streams, the login form and the actions.
Pages are rendered on the server with Jinja (autoescaped: a payload holding `<script>`
is shown as text); the only JavaScript is static/console.js, which applies the live
updates, and no script is ever inline (the Content-Security-Policy forbids it)."""

from __future__ import annotations

import asyncio
import io
import os
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any
from urllib.parse import quote

import jinja2
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool
from starlette.requests import Request
from starlette.responses import (
    HTMLResponse,
    JSONResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from jobrunner.features import results
from jobrunner.server.console import actions, live, reads
from jobrunner.server.console.auth import (
    COOKIE,
    ConsoleError,
    ProxyAuth,
    Viewer,
    check_csrf,
    require_admin,
    viewer,
)
from jobrunner.server.console.filters import STATES, FilterError, TaskFilter
from jobrunner.server.context import Context, context

HERE = Path(__file__).resolve().parent
PREFIX = "/console"
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
                               "img-src 'self' data:; frame-ancestors 'none'; "
                               "form-action 'self'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def _duration(seconds: Any) -> str:
    if seconds is None:
        return "-"
    seconds = float(seconds)
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m {seconds % 60:.0f}s"
    if seconds < 86400:
        return f"{seconds / 3600:.0f}h {seconds % 3600 / 60:.0f}m"
    return f"{seconds / 86400:.1f}d"


def environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"),
                             autoescape=True, trim_blocks=True, lstrip_blocks=True,
                             undefined=jinja2.StrictUndefined)
    env.filters.update(duration=_duration, money=reads.money, urlpart=lambda v: quote(
        str(v), safe=""), num=lambda v: f"{int(v):,}" if v is not None else "-")
    env.globals.update(prefix=PREFIX, states=STATES, count_cap=reads.COUNT_CAP)
    return env


ENV = environment()


def render(name: str, status_code: int = 200, **values: Any) -> HTMLResponse:
    return HTMLResponse(ENV.get_template(name).render(**values), status_code=status_code,
                        headers=HEADERS)


# -- the live fragments (rendered by the hub's thread, one query per topic) ------------
def render_topic(topic: live.Topic, conn: Any) -> dict[str, str] | None:
    kind, scope = topic[0], (topic[-1] or None)
    if kind == "overview":
        views = reads.overview(conn, scope)
        return {"overview-rows": ENV.get_template("_overview_rows.html").render(
            batches=views)}
    if kind == "batch":
        view = reads.batch(conn, topic[1], scope)
        if view is None:
            return None
        return {"batch-counts": ENV.get_template("_batch_counts.html").render(b=view)}
    return None


class Console:
    """What the console keeps per server process: the live updates' hub, and the trusted
    proxy's settings."""

    def __init__(self, ctx: Context, *, min_gap: float, poll: float) -> None:
        self.hub = live.Hub(ctx.settings.dsn, ctx.db, render_topic, min_gap=min_gap,
                            poll=poll)
        s = ctx.settings
        secret = s.console_secret.encode() if s.console_secret else os.urandom(32)
        self.proxy = ProxyAuth(s.console_proxy_auth, s.console_proxy_user_header,
                               s.console_proxy_groups_header, s.console_proxy_admin_group,
                               secret)


def console(request: Request) -> Console:
    found = context(request).extra.get("console")
    if found is None:
        raise ConsoleError(404, "The console is turned off on this server.")
    return found


# -- who is asking ---------------------------------------------------------------------
def _who(request: Request) -> Viewer | None:
    proxy = console(request).proxy
    with context(request).db.connection() as conn:
        return viewer(request, conn, proxy)


def _page_viewer(request: Request) -> Viewer:
    """The viewer of a page; without a valid key, the login form (via the handler)."""
    who = _who(request)
    if who is None:
        raise _LoginRequired(request.url.path + (f"?{request.url.query}"
                                                 if request.url.query else ""))
    return who


class _LoginRequired(Exception):
    def __init__(self, next_path: str) -> None:
        super().__init__(next_path)
        self.next_path = next_path


def _safe_next(value: Any) -> str:
    # Only a path of this console: never another site (an open redirect).
    if isinstance(value, str) and value.startswith(PREFIX) and not value.startswith("//"):
        return value
    return PREFIX


async def login_required(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, _LoginRequired)
    return RedirectResponse(f"{PREFIX}/login?next={quote(exc.next_path, safe='')}", 303)


async def console_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ConsoleError)
    return render("error.html", exc.status, who=None, message=exc.message,
                  status=exc.status)


# -- pages -----------------------------------------------------------------------------
def overview(request: Request) -> Response:
    who = _page_viewer(request)
    with context(request).db.connection() as conn:
        views = reads.overview(conn, who.scope)
    return render("overview.html", who=who, batches=views, cap=reads.COUNT_CAP,
                  page=reads.OVERVIEW_PAGE, events=f"{PREFIX}/events?topic=overview")


def batch_page(request: Request) -> Response:
    who = _page_viewer(request)
    batch_id = request.path_params["batch_id"]
    with context(request).db.connection() as conn:
        view = reads.batch(conn, batch_id, who.scope)
        if view is None:
            raise ConsoleError(404, f"No batch {batch_id!r} here.")
        errors = reads.batch_errors(conn, batch_id)
        detail = reads.batch_detail(conn, view)
        log = reads.audit_recent(conn, who.scope, batch_id, 20)
    return render("batch.html", who=who, b=view, errors=errors, audit=log,
                  cap=reads.COUNT_CAP, d=detail, sample=reads.SAMPLE,
                  errors_sample=reads.ERRORS_SAMPLE,
                  events=f"{PREFIX}/events?topic=batch&batch={quote(batch_id, safe='')}")


def _filter(request: Request) -> tuple[TaskFilter, str | None]:
    try:
        return TaskFilter.from_params(request.query_params), None
    except FilterError as exc:
        return TaskFilter(), str(exc)


def tasks_page(request: Request) -> Response:
    who = _page_viewer(request)
    batch_id = request.path_params["batch_id"]
    filt, problem = _filter(request)
    after = request.query_params.get("after", "")
    with context(request).db.connection() as conn:
        view = reads.batch(conn, batch_id, who.scope)
        if view is None:
            raise ConsoleError(404, f"No batch {batch_id!r} here.")
        page = reads.task_page(conn, batch_id, filt, after) if problem is None else None
    raw = request.query_params
    return render("tasks.html", who=who, b=view, filt=filt, page=page, problem=problem,
                  typed={k: raw.get(k, "") for k in ("state", "prefix", "payload", "shard",
                                                     "attempts", "error")},
                  after=after, scan=reads.SCAN_BUDGET)


def task_page(request: Request) -> Response:
    who = _page_viewer(request)
    batch_id, key = request.path_params["batch_id"], request.path_params["task_key"]
    with context(request).db.connection() as conn:
        view = reads.batch(conn, batch_id, who.scope)
        if view is None:
            raise ConsoleError(404, f"No batch {batch_id!r} here.")
        row = reads.task(conn, batch_id, key)
    if row is None:
        raise ConsoleError(404, f"No task {key!r} in batch {batch_id!r}.")
    return render("task.html", who=who, b=view, t=row)


def dead_page(request: Request) -> Response:
    who = _page_viewer(request)
    with context(request).db.connection() as conn:
        rows = reads.dead_recent(conn, who.scope)
    return render("dead.html", who=who, rows=rows)


def audit_page(request: Request) -> Response:
    who = _page_viewer(request)
    with context(request).db.connection() as conn:
        rows = reads.audit_recent(conn, who.scope, None, 200)
    return render("audit.html", who=who, rows=rows)


def limits_page(request: Request) -> Response:
    who = _page_viewer(request)
    with context(request).db.connection() as conn:
        rows = reads.limits(conn)
    return render("limits.html", who=who, rows=rows)


def pools_page(request: Request) -> Response:
    who = _page_viewer(request)
    with context(request).db.connection() as conn:
        found = reads.pools(conn, who.scope)
    return render("pools.html", who=who, pools=found, cap=reads.COUNT_CAP)


def schedules_page(request: Request) -> Response:
    who = _page_viewer(request)
    with context(request).db.connection() as conn:
        found = reads.schedules(conn, who.scope)
    return render("schedules.html", who=who, **found, shown=reads.SCHEDULE_RUNS_SHOWN,
                  done=request.query_params.get("done"))


def api_batches_page(request: Request) -> Response:
    who = _page_viewer(request)
    with context(request).db.connection() as conn:
        rows, tenants = reads.api_batches(conn, who.scope)
    return render("api_batches.html", who=who, rows=rows, tenants=tenants,
                  shown=reads.API_BATCHES_SHOWN)


async def export(request: Request) -> Response:
    """A batch's results (or, with ?errors=1, its errors) as a download, streamed."""
    who = await run_in_threadpool(_page_viewer, request)
    batch_id, fmt = request.path_params["batch_id"], request.path_params["fmt"]
    if fmt not in results.FORMATS:
        raise ConsoleError(404, f"No export format {fmt!r}: one of {', '.join(results.FORMATS)}")
    errors = request.query_params.get("errors") == "1"
    ctx = context(request)
    with ctx.db.connection() as conn:
        if reads.batch(conn, batch_id, who.scope) is None:
            raise ConsoleError(404, f"No batch {batch_id!r} here.")

    def lines() -> Iterator[str]:
        # The export (one read-only transaction, jobrunner/features/results.py) writes
        # into a pipe on a thread of its own; its chunks are sent as they fill, so memory
        # stays one chunk deep whatever the batch's size.
        pipe = _Pipe()

        def produce() -> None:
            try:
                with ctx.db.connection() as conn:
                    results.export(conn, batch_id, pipe, fmt=fmt, errors=errors)
                pipe.close_writer()
            except BaseException as exc:
                pipe.close_writer(exc)

        threading.Thread(target=produce, daemon=True, name="console-export").start()
        try:
            yield from pipe.chunks()
        finally:
            pipe.cancelled = True

    suffix = {"jsonl": "jsonl", "csv": "csv", "openai": "jsonl"}[fmt]
    name = f"{batch_id}{'-errors' if errors else ''}{'-openai' if fmt == 'openai' else ''}"
    media = "text/csv" if fmt == "csv" else "application/x-ndjson"
    return StreamingResponse(iterate_in_threadpool(lines()), media_type=media, headers={
        **HEADERS, "Content-Disposition": f"attachment; filename=\"{quote(name)}.{suffix}\""})


# -- login -----------------------------------------------------------------------------
class _Pipe(io.TextIOBase):
    """A text file whose writes come out, in chunks of about 64 KiB, of `chunks()`."""

    CHUNK = 64 * 1024

    def __init__(self) -> None:
        self.queue: queue.Queue[str | BaseException | None] = queue.Queue(maxsize=8)
        self.buffer: list[str] = []
        self.size = 0
        self.cancelled = False

    def _put(self, item: str | BaseException | None) -> None:
        while not self.cancelled:
            try:
                self.queue.put(item, timeout=1)
                return
            except queue.Full:
                continue
        raise ConnectionAbortedError("the download was abandoned")

    def write(self, text: str) -> int:
        self.buffer.append(text)
        self.size += len(text)
        if self.size >= self.CHUNK:
            self._put("".join(self.buffer))
            self.buffer, self.size = [], 0
        return len(text)

    def close_writer(self, error: BaseException | None = None) -> None:
        if self.buffer and error is None:
            self._put("".join(self.buffer))
        self._put(error)

    def chunks(self) -> Iterator[str]:
        while True:
            item = self.queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


def login_form(request: Request) -> Response:
    return render("login.html", who=None, next=_safe_next(request.query_params.get("next")),
                  problem=None)


async def login(request: Request) -> Response:
    origin = request.headers.get("origin")
    if origin and origin != f"{request.url.scheme}://{request.headers.get('host', '')}":
        # (another site logging a browser into a key of its choosing)
        raise ConsoleError(403, "Refused: this login was sent from another site.")
    form = await request.form()
    key = str(form.get("key") or "").strip()
    next_path = _safe_next(form.get("next"))
    ctx = context(request)

    def check() -> bool:
        from jobrunner.store import batch_api as keys
        with ctx.db.connection() as conn:
            return bool(key) and keys.find_key(conn, key) is not None

    if not await run_in_threadpool(check):
        return render("login.html", 401, who=None, next=next_path,
                      problem="That key is not a live API key.")
    response = RedirectResponse(next_path, 303, headers=HEADERS)
    # Secure: sent over HTTPS only (browsers count http://localhost as secure, so a
    # port-forward works); HttpOnly: no script reads it; Strict: no other site's
    # request carries it.
    response.set_cookie(COOKIE, key, httponly=True, secure=True, samesite="strict",
                        path=PREFIX, max_age=12 * 3600)
    return response


async def logout(request: Request) -> Response:
    form = await request.form()
    who = await run_in_threadpool(_who, request)
    if who is not None:
        check_csrf(request, who, form.get("csrf"))
    response = RedirectResponse(f"{PREFIX}/login", 303, headers=HEADERS)
    response.delete_cookie(COOKIE, path=PREFIX, secure=True, httponly=True,
                           samesite="strict")
    return response


# -- actions ---------------------------------------------------------------------------
async def _action_viewer(request: Request) -> tuple[Viewer, Any]:
    form = await request.form()
    who = await run_in_threadpool(_who, request)
    if who is None:
        raise ConsoleError(401, "Log in with an admin key to act.")
    check_csrf(request, who, form.get("csrf"))
    require_admin(who)
    return who, form


async def requeue(request: Request) -> Response:
    """Requeue dead tasks: without `confirmed`, a page that counts what would move and
    asks; with it (and the count it showed), the requeue itself."""
    who, form = await _action_viewer(request)
    batch_id = request.path_params["batch_id"]
    try:
        filt = TaskFilter.from_params({k: form.get(k) for k in ("prefix", "payload", "shard",
                                                                "attempts", "error")}
                                      | {"state": "dead"})
    except FilterError as exc:
        raise ConsoleError(400, str(exc)) from None
    key = form.get("task_key")
    target = actions.Target(str(key) if key else None, filt)
    ctx = context(request)

    def run() -> Response:
        with ctx.db.connection() as conn:
            if form.get("confirmed") != "1":
                n = actions.count_dead(conn, who, batch_id, target)
                return render("confirm_requeue.html", who=who, batch_id=batch_id,
                              target=target, count=n, cap=reads.BULK_CAP)
            try:
                expected = int(str(form.get("expected", "")))
            except ValueError:
                raise ConsoleError(400, "The confirmed count is missing.") from None
            moved = actions.requeue_dead(conn, who, batch_id, target, expected)
        back = f"{PREFIX}/batches/{quote(batch_id, safe='')}?done=requeued-{moved}"
        return RedirectResponse(back, 303, headers=HEADERS)

    return await run_in_threadpool(run)


async def cancel(request: Request) -> Response:
    who, form = await _action_viewer(request)
    batch_id = request.path_params["batch_id"]
    ctx = context(request)

    def run() -> Response:
        with ctx.db.connection() as conn:
            if form.get("confirmed") != "1":
                view = reads.batch(conn, batch_id, who.scope)
                if view is None:
                    raise ConsoleError(404, f"No batch {batch_id!r} here.")
                return render("confirm_cancel.html", who=who, b=view)
            moved = actions.cancel_batch(conn, who, batch_id)
        back = f"{PREFIX}/batches/{quote(batch_id, safe='')}?done=cancelled-{moved}"
        return RedirectResponse(back, 303, headers=HEADERS)

    return await run_in_threadpool(run)


def _back(path: str, done: str) -> Response:
    return RedirectResponse(f"{PREFIX}{path}?done={quote(done, safe='')}", 303,
                            headers=HEADERS)


async def limit_action(request: Request) -> Response:
    """Pause or resume a limit (an operator's admin)."""
    who, _form = await _action_viewer(request)
    name, verb = request.path_params["name"], request.path_params["verb"]
    if verb not in ("pause", "resume"):
        raise ConsoleError(404, "Limits are paused or resumed.")
    ctx = context(request)

    def run() -> Response:
        with ctx.db.connection() as conn:
            actions.set_limit_paused(conn, who, name, verb == "pause")
        return _back("/limits", f"{verb}d-{name}")

    return await run_in_threadpool(run)


async def budget(request: Request) -> Response:
    """Raise a batch's token or cost budget."""
    who, form = await _action_viewer(request)
    batch_id = request.path_params["batch_id"]
    tokens_text = str(form.get("tokens") or "").strip()
    cost_text = str(form.get("cost") or "").strip()
    try:
        tokens = int(tokens_text) if tokens_text else None
        cost = Decimal(cost_text) if cost_text else None
    except (ValueError, InvalidOperation):
        raise ConsoleError(400, "A budget is a whole number of tokens or a decimal cost."
                           ) from None
    ctx = context(request)

    def run() -> Response:
        with ctx.db.connection() as conn:
            actions.raise_budget(conn, who, batch_id, tokens=tokens, cost=cost)
        return _back(f"/batches/{quote(batch_id, safe='')}", "budget-raised")

    return await run_in_threadpool(run)


async def pool_weight(request: Request) -> Response:
    """Set a tenant's weight in a pool (an operator's admin)."""
    who, form = await _action_viewer(request)
    pool, tenant = request.path_params["pool"], str(form.get("tenant") or "")
    try:
        weight = float(str(form.get("weight", "")))
    except ValueError:
        raise ConsoleError(400, "A weight is a number between 0.001 and 1000.") from None
    ctx = context(request)

    def run() -> Response:
        with ctx.db.connection() as conn:
            actions.set_pool_weight(conn, who, pool, tenant, weight)
        return _back("/pools", f"weight-{pool}-{tenant}")

    return await run_in_threadpool(run)


async def trigger_schedule(request: Request) -> Response:
    """"Trigger now": a request the controller takes (this server has no Kubernetes
    access); the schedules page shows what became of it."""
    who, _form = await _action_viewer(request)
    namespace, name = request.path_params["namespace"], request.path_params["name"]
    ctx = context(request)

    def run() -> Response:
        with ctx.db.connection() as conn:
            trigger = actions.trigger_schedule(conn, who, namespace, name)
        return _back("/schedules", f"triggered-{trigger}")

    return await run_in_threadpool(run)


# -- live updates ----------------------------------------------------------------------
async def events(request: Request) -> Response:
    who = await run_in_threadpool(_who, request)
    if who is None:
        return Response("log in first\n", 401, media_type="text/plain")
    hub = console(request).hub
    kind = request.query_params.get("topic")
    if kind == "overview":
        topic: live.Topic = ("overview", who.scope or "")
    elif kind == "batch" and request.query_params.get("batch"):
        topic = ("batch", request.query_params["batch"], who.scope or "")
    else:
        return Response("topic: overview, or batch with batch=ID\n", 400,
                        media_type="text/plain")

    async def stream() -> AsyncIterator[str]:
        queue = hub.subscribe(topic)
        try:
            yield "retry: 2000\n\n"
            while True:
                try:
                    fragments = await asyncio.wait_for(queue.get(), 15)
                except TimeoutError:
                    yield ": keep-alive\n\n"
                    continue
                if fragments is None:
                    return
                yield live.event(fragments)
        finally:
            hub.unsubscribe(topic, queue)

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={**HEADERS, "X-Accel-Buffering": "no"})


def live_stats(request: Request) -> Response:
    """The hub's counters (refreshes, notifications, viewers): what the live updates
    cost this process's database connections."""
    if _who(request) is None:
        return Response("log in first\n", 401, media_type="text/plain")
    hub = console(request).hub
    s = hub.stats
    return JSONResponse({"refreshes": s.refreshes, "notifications": s.notifications,
                         "published": s.published, "listening": s.listening,
                         "per_topic": s.per_topic, "subscribers": hub.subscribers()})


routes = [
    Route(PREFIX, lambda request: RedirectResponse(f"{PREFIX}/", 307)),
    Mount(PREFIX, routes=[
        Route("/", overview),
        Route("/login", login_form, methods=["GET"]),
        Route("/login", login, methods=["POST"]),
        Route("/logout", logout, methods=["POST"]),
        Route("/dead", dead_page),
        Route("/audit", audit_page),
        Route("/limits", limits_page),
        Route("/limits/{name}/{verb}", limit_action, methods=["POST"]),
        Route("/pools", pools_page),
        Route("/pools/{pool}/weight", pool_weight, methods=["POST"]),
        Route("/schedules", schedules_page),
        Route("/schedules/{namespace}/{name}/trigger", trigger_schedule, methods=["POST"]),
        Route("/api-batches", api_batches_page),
        Route("/events", events),
        Route("/events/stats", live_stats),
        # Batch ids hold slashes (a BatchRun's is namespace/name/uid, and the server sees
        # %2F decoded): each id is a path, the more specific routes first.
        Route("/batches/{batch_id:path}/tasks/{task_key:path}", task_page),
        Route("/batches/{batch_id:path}/tasks", tasks_page),
        Route("/batches/{batch_id:path}/export.{fmt}", export),
        Route("/batches/{batch_id:path}/requeue", requeue, methods=["POST"]),
        Route("/batches/{batch_id:path}/cancel", cancel, methods=["POST"]),
        Route("/batches/{batch_id:path}/budget", budget, methods=["POST"]),
        Route("/batches/{batch_id:path}", batch_page),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="console-static"),
    ]),
]

HANDLERS = {ConsoleError: console_error, _LoginRequired: login_required}

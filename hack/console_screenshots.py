"""Regenerate the console's screenshots in docs/console/ (docs/console.md) from a real run
of the demo: an embedded PostgreSQL, `jobrunner serve`, `jobrunner run
examples/summarise.yaml` (the `make demo` run), a small batch whose tasks die, a limit,
a pool with two tenants, a Batch API batch row and a scheduled run's batch; Debian's
headless Chromium through Selenium and Debian's chromedriver (nothing downloaded).

    python hack/console_screenshots.py            # -> docs/console/*.png

Each PNG is quantised to 64 colours (Pillow) to stay small. Run it under the heavy lock
(it starts PostgreSQL, a server, workers and a browser)."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psycopg
from PIL import Image
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from jobrunner.local.embedded import EmbeddedPostgres, free_port
from jobrunner.store import schedules

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "docs" / "console"
DEMO = "local/summarise-stdlib-docs"
HANDLER = "tests.support.console_handlers:handle"


def env(dsn: str) -> dict[str, str]:
    e = dict(os.environ, JOBRUNNER_DATABASE_URL=dsn)
    e["PYTHONPATH"] = os.pathsep.join([str(REPO), e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return e


def jr(dsn: str, *args: str, input: str | None = None) -> str:
    return subprocess.run([sys.executable, "-m", "jobrunner", *args], env=env(dsn), cwd=REPO,
                          input=input, capture_output=True, text=True, check=True).stdout


def spawn(dsn: str, *args: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jobrunner", *args], env=env(dsn), cwd=REPO,
                            stdout=log.open("ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait(predicate, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.2)
    raise TimeoutError(f"waiting for {what}")


def status_count(dsn: str, batch: str, status: str) -> int:
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT count(*) FROM agent_work_queue WHERE batch_id = %s "
                            "AND status = %s", (batch, status)).fetchone()[0]


def setup(dsn: str, tmp: Path) -> None:
    """What the demo run does not make: dead tasks, a limit, a pool, an API batch, a
    schedule with its runs and a trigger."""
    flag = tmp / "fail"
    flag.write_text("x")
    rows = [{"key": f"invoice-{i:02d}", "payload": {
        "doc": "csv" if i % 3 else "pdf", "fail_while": str(flag)}} for i in range(6)]
    rows += [{"key": f"report-{i:02d}", "payload": {"doc": "txt"}} for i in range(10)]
    jr(dsn, "enqueue", "-", "--batch", "acme/invoices", "--tenant", "acme",
       "--max-attempts", "2", input="".join(json.dumps(r) + "\n" for r in rows))
    worker = spawn(dsn, "worker", "--batch", "acme/invoices", "--handler", HANDLER,
                   "--backoff-base", "0.05", "--backoff-cap", "0.2", log=tmp / "worker.log")
    wait(lambda: status_count(dsn, "acme/invoices", "dead") == 6, 60, "the dead tasks")
    worker.kill()
    jr(dsn, "limit", "set", "llm", "--requests", "600", "--max-concurrent", "8")
    jr(dsn, "limit", "set", "embeddings", "--tokens", "200000", "--per", "60")
    for tenant, n in (("acme", 40), ("globex", 25)):
        jr(dsn, "enqueue", "-", "--batch", f"{tenant}/gpu-jobs", "--tenant", tenant, "--pool",
           "gpu", input="".join(json.dumps({"key": f"j{i:03d}", "payload": {}}) + "\n"
                                for i in range(n)))
    jr(dsn, "pool", "set-weight", "gpu", "acme", "3")
    stamp = int(time.time()) // 60 // 1440 * 1440 + 120  # (02:00 UTC today)
    for day in range(3):
        jr(dsn, "enqueue", "-", "--batch", f"ops/nightly-{stamp - 1440 * day}/"
           f"{'0a1b2c3d4e5f'[day:day + 8]}", "--tenant", "acme",
           input='{"key": "sweep", "payload": {}}\n')
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("""
            INSERT INTO api_batch (batch_id, tenant_id, input_file_id, endpoint,
                                   completion_window, model, status, total, completed,
                                   failed, expires_at, created_at)
            VALUES ('batch_6f1c2e', 'acme', 'file-a1', '/v1/chat/completions', '24h',
                    'llama-3.1-8b', 'completed', 1200, 1187, 13, now() + interval '1 day',
                    now() - interval '3 hours'),
                   ('batch_9d04b7', 'globex', 'file-g7', '/v1/chat/completions', '24h',
                    'qwen2.5-7b', 'in_progress', 500, 212, 0, now() + interval '1 day',
                    now() - interval '20 minutes')""")
        # (what the controller writes of the schedule, and a console trigger it answered)
        last = dt.datetime.fromtimestamp(stamp * 60, dt.UTC)
        schedules.put_state(conn, schedules.ScheduleState(
            "ops", "nightly", "acme", "0 3 * * *", "Europe/Paris", False, "Forbid",
            "Scheduled", f"next start time {last + dt.timedelta(days=1):%Y-%m-%dT%H:%M:%SZ}"
            " (0 3 * * * in Europe/Paris)", last + dt.timedelta(days=1), last, last, ()))
        trigger = schedules.request_trigger(conn, namespace="ops", name="nightly",
                                            tenant_id="acme", requested_by="demo")["id"]
        schedules.answer_trigger(conn, trigger, outcome=schedules.STARTED,
                                 run_name=f"nightly-manual-console-{trigger}",
                                 message=f"started BatchRun nightly-manual-console-{trigger}")


def browser() -> webdriver.Chrome:
    options = Options()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,860", "--no-first-run",
                f"--user-data-dir={tempfile.mkdtemp(prefix='jr-shots-')}"):
        options.add_argument(arg)
    return webdriver.Chrome(options=options,
                            service=Service(executable_path="/usr/bin/chromedriver"))


def shoot(driver: webdriver.Chrome, name: str) -> None:
    path = OUT / f"{name}.png"
    driver.save_screenshot(str(path))
    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=64, method=Image.Quantize.MEDIANCUT)
        small.save(path, optimize=True)
    print(f"{path.relative_to(REPO)}: {path.stat().st_size // 1024} KiB")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="jr-console-shots-"))
    pg = EmbeddedPostgres(tmp / "pg")
    procs: list[subprocess.Popen] = []
    driver = None
    try:
        dsn = pg.start()
        jr(dsn, "migrate")
        setup(dsn, tmp)
        key = jr(dsn, "api-key", "create", "--tenant", "*", "--role", "admin", "--name",
                 "oncall").strip()
        port = free_port()
        procs.append(spawn(dsn, "serve", "--port", str(port), log=tmp / "serve.log"))
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            try:
                return httpx.get(f"{url}/readyz", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait(ready, 60, "jobrunner serve")
        driver = browser()
        driver.get(f"{url}/console/login?next=%2Fconsole%2F")
        driver.find_element(By.ID, "key").send_keys(key)
        driver.find_element(By.ID, "login").click()
        WebDriverWait(driver, 20).until(lambda d: d.find_elements(By.ID, "who-role"))
        # the demo, as `make demo` runs it (its own console off: this one watches)
        demo = spawn(dsn, "run", "examples/summarise.yaml", "--dsn", dsn, log=tmp / "demo.log")
        procs.append(demo)
        wait(lambda: status_count(dsn, DEMO, "done") >= 8, 120, "the demo to get going")
        driver.get(f"{url}/console/")
        time.sleep(2.5)  # (a live refresh: rates need two samples)
        shoot(driver, "overview")
        assert demo.wait(600) == 0, (tmp / "demo.log").read_text()[-2000:]
        batch = DEMO.replace("/", "%2F")
        for name, path in (
                ("batch", f"/console/batches/{batch}"),
                ("tasks", f"/console/batches/{batch}/tasks?payload=payload.doc+%3D+argparse"),
                ("task", "/console/batches/acme%2Finvoices/tasks/invoice-00"),
                ("dead", "/console/dead"),
                ("limits", "/console/limits"),
                ("pools", "/console/pools"),
                ("schedules", "/console/schedules"),
                ("api-batches", "/console/api-batches")):
            driver.get(url + path)
            # (the task page's attempts are below its payload and error: a taller window)
            driver.set_window_size(1280, 1500 if name == "task" else 860)
            shoot(driver, name)
        driver.set_window_size(1280, 860)
        # an action, seen in the audit: pause a limit and resume it
        driver.get(f"{url}/console/limits")
        row = 'tr[data-name="llm"] button.'
        for button, then in (("pause", "resume"), ("resume", "pause")):
            driver.find_element(By.CSS_SELECTOR, row + button).click()
            WebDriverWait(driver, 20).until(
                lambda d, t=then: d.find_elements(By.CSS_SELECTOR, row + t))
        driver.get(f"{url}/console/batches/acme%2Finvoices/tasks?state=dead")
        driver.find_element(By.ID, "requeue-filter").click()
        WebDriverWait(driver, 20).until(lambda d: d.find_elements(By.ID, "confirm"))
        shoot(driver, "confirm-requeue")
        driver.get(f"{url}/console/audit")
        shoot(driver, "audit")
    finally:
        if driver is not None:
            driver.quit()
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait(10)
        pg.destroy()


if __name__ == "__main__":
    main()

"""The web console in a real browser: Debian's headless Chromium driven by Selenium
through Debian's chromedriver (both from `make system-deps`; nothing is downloaded, and
Selenium Manager is never run: the driver's path is given). Against a real `jobrunner
serve`, real PostgreSQL and real `jobrunner worker` processes.

Without chromium the tests skip; under CI=true a skip fails (tests/conftest.py), so CI
cannot pass without them."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.support.console import ConsoleServer, counts, enqueue, module_database, worker
from tests.support.processes import cli, wait_for

CHROMIUM = Path(os.environ.get("JOBRUNNER_CHROMIUM", "/usr/bin/chromium"))
CHROMEDRIVER = Path(os.environ.get("JOBRUNNER_CHROMEDRIVER", "/usr/bin/chromedriver"))

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.common.exceptions import (  # noqa: E402
    NoSuchElementException,
    StaleElementReferenceException,
)
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture(scope="module")
def module_dsn(pg_admin_dsn: str, template_db: str) -> Iterator[str]:
    yield from module_database(pg_admin_dsn, template_db)


@pytest.fixture(scope="module")
def server(module_dsn: str, tmp_path_factory) -> Iterator[ConsoleServer]:
    s = ConsoleServer(module_dsn, tmp_path_factory.mktemp("console-browser")).start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def new_browser(tmp_path_factory) -> Iterator[Callable[[], webdriver.Chrome]]:
    """Make headless Chromium sessions (each a fresh profile: its own cookies)."""
    if not CHROMIUM.is_file() or not CHROMEDRIVER.is_file():
        pytest.skip(f"no {CHROMIUM} or {CHROMEDRIVER}: apt-get install chromium "
                    "chromium-driver (make system-deps)")
    logs = tmp_path_factory.mktemp("chromedriver")
    made: list[webdriver.Chrome] = []

    def make() -> webdriver.Chrome:
        options = Options()
        options.binary_location = str(CHROMIUM)
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                    "--disable-gpu", "--window-size=1400,1000", "--no-first-run",
                    f"--user-data-dir={tempfile.mkdtemp(dir=logs)}"):
            options.add_argument(arg)
        # The explicit driver path: Selenium Manager (which would download one) is skipped.
        service = Service(executable_path=str(CHROMEDRIVER),
                          log_output=str(logs / f"chromedriver-{len(made)}.log"))
        driver = webdriver.Chrome(options=options, service=service)
        driver.set_page_load_timeout(30)
        made.append(driver)
        return driver

    yield make
    for driver in made:
        driver.quit()


def login(driver, server: ConsoleServer, key: str, then: str = "/console/") -> None:
    """Log in through the form (the cookie it sets carries the session)."""
    driver.get(f"{server.url}/console/login?next={quote(then, safe='')}")
    driver.find_element(By.ID, "key").send_keys(key)
    driver.find_element(By.ID, "login").click()
    WebDriverWait(driver, 20).until(lambda d: d.find_elements(By.ID, "who-role"))


def until(driver, predicate, timeout: float = 30, what: str = "the page"):
    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(
        lambda d: predicate(d), message=f"waiting for {what}")


def text_of(driver, css: str) -> str | None:
    """The element's text now; the live updates replace elements, so a stale one is
    looked up again."""
    for _ in range(20):
        try:
            return driver.find_element(By.CSS_SELECTOR, css).text
        except NoSuchElementException:
            return None
        except StaleElementReferenceException:
            continue
    raise AssertionError(f"{css} kept changing under the test")


@pytest.fixture(scope="module")
def dead_batch(server: ConsoleServer, tmp_path_factory) -> str:
    """Batch web-dead of tenant acme: 3 csv and 3 pdf tasks dead (the handler refused
    them), 2 done."""
    flag = tmp_path_factory.mktemp("flag") / "fail"
    flag.write_text("x")
    rows = [{"key": f"d{i}", "payload": {"doc": "csv" if i < 3 else "pdf",
                                         "fail_while": str(flag)}} for i in range(6)]
    rows += [{"key": f"ok{i}", "payload": {"doc": "txt"}} for i in range(2)]
    enqueue(server.dsn, "web-dead", "acme", rows)
    proc = worker(server.dsn, "web-dead")
    try:
        wait_for(lambda: counts(server.dsn, "web-dead")["dead"] == 6
                 and counts(server.dsn, "web-dead")["done"] == 2, what="web-dead to settle")
    finally:
        proc.kill()
        proc.wait(10)
    return "web-dead"


def test_the_overview_shows_progress_move_without_a_reload(server, new_browser):
    enqueue(server.dsn, "web-live", "acme",
            [{"key": f"k{i:03d}", "payload": {"sleep": 0.3}} for i in range(30)])
    driver = new_browser()
    login(driver, server, server.key("acme"))
    row = 'tr[data-batch="web-live"] .figure'
    assert text_of(driver, row) == "0/30 done"
    driver.execute_script("window.__notReloaded = true;")
    worker(server.dsn, "web-live", concurrency=2)
    seen = set()

    def moved(d) -> bool:
        text = text_of(d, row)
        if text:
            seen.add(text)
        return len(seen - {"0/30 done"}) >= 2  # (two different counts: it moves)

    until(driver, moved, what="the progress to move")
    assert driver.execute_script("return window.__notReloaded === true;")
    assert int(driver.find_element(By.TAG_NAME, "body").get_attribute("data-updates")) >= 2
    assert "on" in driver.find_element(By.ID, "live").get_attribute("class")
    # once every task is done, the batch leaves the open batches, still without a reload
    until(driver, lambda d: text_of(d, row) is None, timeout=60, what="web-live to finish")
    assert driver.execute_script("return window.__notReloaded === true;")


def test_the_task_browser_filters_by_a_payload_field(server, new_browser):
    docs = ["csv", "pdf", "txt"]
    enqueue(server.dsn, "web-filter", "acme",
            [{"key": f"f{i:02d}", "payload": {"doc": docs[i % 3], "n": i}}
             for i in range(12)])
    driver = new_browser()
    login(driver, server, server.key("acme"), "/console/batches/web-filter/tasks")
    assert len(driver.find_elements(By.CSS_SELECTOR, "tr.task")) == 12
    driver.find_element(By.ID, "f-payload").send_keys('payload.doc = "csv"')
    driver.find_element(By.ID, "f-apply").click()
    until(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, "tr.task")) == 4,
          what="the filtered page")
    keys = [r.get_attribute("data-key") for r in driver.find_elements(By.CSS_SELECTOR,
                                                                      "tr.task")]
    assert keys == ["f00", "f03", "f06", "f09"]
    assert "payload=payload.doc" in driver.current_url
    assert driver.find_element(By.ID, "f-payload").get_attribute("value") == 'payload.doc = "csv"'


def test_a_dead_task_shows_its_error_and_where_it_was_raised(server, new_browser,
                                                             dead_batch):
    driver = new_browser()
    login(driver, server, server.key("acme"), "/console/dead")
    driver.find_element(By.LINK_TEXT, "d0").click()
    until(driver, lambda d: d.find_elements(By.ID, "traceback"), what="the task page")
    trace = driver.find_element(By.ID, "traceback").text
    assert "ValueError: task d0 refused" in trace
    assert "(at console_handlers.py:" in trace
    assert driver.find_element(By.ID, "task-state").text == "dead"


def test_an_admin_requeues_the_dead_tasks_of_a_filter_and_sees_them_run(
        server, new_browser, tmp_path):
    flag = tmp_path / "fail"
    flag.write_text("x")
    enqueue(server.dsn, "web-requeue", "acme", [
        {"key": f"r{i}", "payload": {"doc": "csv" if i % 2 else "pdf",
                                     "fail_while": str(flag)}} for i in range(8)])
    proc = worker(server.dsn, "web-requeue")
    wait_for(lambda: counts(server.dsn, "web-requeue")["dead"] == 8, what="8 dead tasks")
    driver = new_browser()
    login(driver, server, server.key("acme", "admin"),
          "/console/batches/web-requeue/tasks?state=dead&payload="
          + quote('payload.doc = "csv"'))
    assert len(driver.find_elements(By.CSS_SELECTOR, "tr.task")) == 4
    driver.find_element(By.ID, "requeue-filter").click()
    until(driver, lambda d: d.find_elements(By.ID, "confirm"), what="the confirmation")
    assert driver.find_element(By.ID, "confirm-count").get_attribute("data-count") == "4"
    assert counts(server.dsn, "web-requeue")["dead"] == 8  # (nothing moved before confirming)
    flag.unlink()  # (the requeued tasks now succeed)
    driver.find_element(By.ID, "confirm").click()
    until(driver, lambda d: d.find_elements(By.ID, "batch-counts"), what="the batch page")
    # the running worker picks them up (the requeue's NOTIFY wakes it); the page follows live
    until(driver, lambda d: text_of(d, "#count-done") == "4", timeout=60,
          what="the requeued tasks to run")
    assert text_of(driver, "#count-dead") == "4"
    assert counts(server.dsn, "web-requeue") | {} == {
        "pending": 0, "leased": 0, "done": 4, "dead": 4, "cancelled": 0}
    proc.kill()
    driver.refresh()
    audit = driver.find_element(By.ID, "audit")
    assert "requeue_dead" in audit.text
    assert audit.find_element(By.CSS_SELECTOR, "td.rows").text == "4"
    assert "payload.doc" in audit.text


def test_the_same_action_is_refused_to_a_read_key(server, new_browser, dead_batch):
    driver = new_browser()
    login(driver, server, server.key("acme"), "/console/batches/web-dead/tasks?state=dead")
    assert driver.find_element(By.ID, "who-role").text == "read"
    assert not driver.find_elements(By.ID, "requeue-filter")  # (no button to press)
    # A forged form with this session's own CSRF token (taken from the logout form):
    # the server refuses the action for the role, not for the token.
    driver.execute_script("""
        const token = document.querySelector('input[name=csrf]').value;
        const form = document.createElement('form');
        form.method = 'post';
        form.action = '/console/batches/web-dead/requeue';
        for (const [name, value] of [['csrf', token], ['confirmed', '1'],
                                     ['expected', '6']]) {
            const input = document.createElement('input');
            input.type = 'hidden'; input.name = name; input.value = value;
            form.appendChild(input);
        }
        document.body.appendChild(form);
        form.submit();""")
    until(driver, lambda d: d.find_elements(By.ID, "problem"), what="the refusal")
    assert "role is read" in driver.find_element(By.ID, "problem").text
    assert driver.find_element(By.TAG_NAME, "h1").text == "403"
    assert counts(server.dsn, "web-dead")["dead"] == 6


def test_a_payload_holding_a_script_is_shown_as_text(server, new_browser):
    enqueue(server.dsn, "web-xss", "acme", [{"key": "x<b>1</b>", "payload": {
        "doc": "<script>window.__xss = 1</script>",
        "img": '<img src=x onerror="window.__xss = 2">'}}])
    driver = new_browser()
    login(driver, server, server.key("acme"), "/console/batches/web-xss/tasks")
    assert driver.find_element(By.CSS_SELECTOR, "tr.task a").text == "x<b>1</b>"
    driver.find_element(By.CSS_SELECTOR, "tr.task a").click()
    until(driver, lambda d: d.find_elements(By.ID, "payload"), what="the task page")
    payload = driver.find_element(By.ID, "payload").text
    assert "<script>window.__xss = 1</script>" in payload
    assert '<img src=x onerror=\\"window.__xss = 2\\">' in payload
    assert driver.find_element(By.ID, "task-key").text == "x<b>1</b>"
    assert driver.execute_script("return window.__xss === undefined;")
    assert not driver.find_elements(By.CSS_SELECTOR, "#payload script, #payload img, b")


def test_an_operator_pauses_a_limit_sets_a_weight_and_sees_both_in_the_audit(
        server, new_browser):
    cli("limit", "set", "web-llm", "--requests", "60", dsn=server.dsn, check=True)
    cli("enqueue", "-", "--batch", "web-pool", "--tenant", "acme", "--pool", "web-gpu",
        dsn=server.dsn, input='{"key": "a", "payload": {}}\n', check=True)
    driver = new_browser()
    login(driver, server, server.key("*", "admin"), "/console/limits")
    row = 'tr[data-name="web-llm"]'
    driver.find_element(By.CSS_SELECTOR, f"{row} button.pause").click()
    until(driver, lambda d: text_of(d, f"{row} td.blocked") == "paused", what="the pause")
    driver.find_element(By.CSS_SELECTOR, f"{row} button.resume").click()
    until(driver, lambda d: text_of(d, f"{row} td.blocked") == "-", what="the resume")
    driver.get(f"{server.url}/console/pools")
    tenant = 'section[data-pool="web-gpu"] tr[data-tenant="acme"]'
    field = driver.find_element(By.CSS_SELECTOR, f"{tenant} input.weight-input")
    field.clear()
    field.send_keys("4")
    driver.find_element(By.CSS_SELECTOR, f"{tenant} button.set-weight").click()
    until(driver, lambda d: (text_of(d, f"{tenant} td.weight") or "").startswith("4"),
          what="the new weight")
    driver.get(f"{server.url}/console/audit")
    audit = driver.find_element(By.ID, "audit").text
    assert "pause_limit" in audit and "resume_limit" in audit and "set_pool_weight" in audit


def test_the_batch_page_draws_its_throughput_and_attempts(server, new_browser, dead_batch):
    driver = new_browser()
    login(driver, server, server.key("acme"), "/console/batches/web-dead")
    bars = driver.find_elements(By.CSS_SELECTOR, "#throughput-chart rect")
    assert len(bars) == 30 and sum(int(b.get_attribute("data-count")) for b in bars) == 2
    assert driver.find_element(By.ID, "throughput-chart").size["height"] > 100
    rows = driver.find_elements(By.CSS_SELECTOR, "#attempts-histogram tbody tr")
    assert [r.get_attribute("data-attempts") for r in rows] == ["1"]
    assert [r.get_attribute("href").rsplit("/", 1)[-1] for r in driver.find_elements(
        By.CSS_SELECTOR, "#result-preview a")] == ["ok0", "ok1"]
    assert not driver.find_elements(By.ID, "raise-budget")  # (a read key, no budget)

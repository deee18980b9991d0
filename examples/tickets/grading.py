"""Nightly ticket grading: a generator selects the support tickets not graded yet, one
task per ticket grades it and stores the grade exactly once (docs/sources.md).

- `ungraded` (the BatchRun's source.generator) creates the example's tables in the
  batch's database and fills `tickets` (idempotently: the same args.tickets tickets
  every time), then yields one task per ticket without a grade, keyed by ticket id, so a
  re-run of the generator after a crash adds only the tickets it had not enqueued yet.
- `grade` (the handler) grades a ticket: priority P1..P4 and a category, by a
  deterministic local grader, or by the OpenAI-compatible endpoint of
  examples/summarise when JOBRUNNER_LLM_BASE_URL is set (the task's idempotency key as
  the request's Idempotency-Key). The grade is written through `task.once`, so a retry
  after a crash never writes it twice; the insert also skips a ticket another batch
  graded meanwhile (two nights overlapping).

Running it twice grades nothing twice: the second night's generator finds no ungraded
ticket (or only the new ones).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jobrunner import PermanentError, Task, db

SCHEMA = Path(__file__).with_name("schema.sql")

PRODUCTS = ("billing", "login", "export", "mobile app", "API", "dashboard")
PROBLEMS = (
    ("is down for everyone", "Since this morning nothing works at all; the whole team is "
     "blocked and customers are affected. Outage?"),
    ("charged twice", "My card was charged twice this month. Please refund the duplicate."),
    ("is slow", "Pages take ten seconds to load since the last update."),
    ("question about limits", "How many seats does our plan include? Just curious."),
    ("error 500 on save", "Saving fails with an error 500 every time, data may be lost."),
    ("feature request: dark mode", "It would be nice to have a dark theme."),
    ("cannot reset password", "The reset email never arrives, I am locked out."),
)

# The local grader's rules: the first that matches wins (deterministic, no model needed).
RULES = (
    (("down", "outage", "data may be lost", "locked out"), "P1"),
    (("charged twice", "refund", "error 500"), "P2"),
    (("slow", "fails"), "P3"),
)
CATEGORIES = (("charged", "billing"), ("refund", "billing"), ("password", "access"),
              ("locked out", "access"), ("feature request", "feedback"),
              ("slow", "performance"), ("error", "bug"), ("down", "incident"))


def ticket(i: int) -> tuple[int, str, str]:
    """Ticket i of the example's data: the same every time."""
    product = PRODUCTS[i % len(PRODUCTS)]
    problem, body = PROBLEMS[(i * 3) % len(PROBLEMS)]
    return i, f"{product} {problem}", f"[{product}] {body}"


def _connect():
    # The batch's own database: workers have its DSN in JOBRUNNER_DATABASE_URL.
    return db.connect(db.resolve_dsn(None), purpose="tickets-example")


def ungraded(task: Task, args: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The generator: set the example up, then one task per ticket without a grade."""
    count = int(args.get("tickets", 60))
    with _connect() as conn:
        conn.execute(SCHEMA.read_text())
        with conn.cursor() as cur:
            cur.executemany("INSERT INTO tickets (id, subject, body) VALUES (%s, %s, %s)"
                            " ON CONFLICT (id) DO NOTHING",
                            [ticket(i) for i in range(1, count + 1)])
        conn.commit()
        rows = conn.execute(
            "SELECT t.id, t.subject, t.body FROM tickets t"
            " WHERE NOT EXISTS (SELECT 1 FROM ticket_grades g WHERE g.ticket_id = t.id)"
            " ORDER BY t.id").fetchall()
        conn.rollback()
    for row in rows:
        yield {"key": f"ticket-{row['id']}",
               "payload": {"ticket_id": row["id"], "subject": row["subject"],
                           "body": row["body"]}}


def local_grade(text: str) -> tuple[str, str]:
    lowered = text.lower()
    priority = next((p for words, p in RULES if any(w in lowered for w in words)), "P4")
    category = next((c for word, c in CATEGORIES if word in lowered), "question")
    return priority, category


def model_grade(task: Task, text: str) -> tuple[str, str]:
    from examples.summarise.handler import approx_tokens, chat

    answer, usage = chat("Grade this support ticket. Answer with a priority P1 (urgent) to "
                         "P4 (no rush) and a one-word category, as: P2 billing", text,
                         task.idempotency_key("grade"))
    task.report_usage(input_tokens=int(usage.get("prompt_tokens") or approx_tokens(text)),
                      output_tokens=int(usage.get("completion_tokens")
                                        or approx_tokens(answer)))
    words = answer.replace(",", " ").split()
    priority = next((w.upper() for w in words if w.upper() in ("P1", "P2", "P3", "P4")), None)
    if priority is None:
        raise RuntimeError(f"the model's answer has no priority: {answer[:200]!r}")
    rest = [w for w in words if w.upper() != priority]
    return priority, (rest[0].lower().strip(".") if rest else "question")


def grade(task: Task) -> dict[str, Any]:
    """The handler: grade one ticket and store the grade once."""
    payload = task.payload
    if "ticket_id" not in payload:
        raise PermanentError("not a ticket task: no ticket_id in the payload")
    text = f"{payload.get('subject', '')}\n{payload.get('body', '')}"
    if os.environ.get("JOBRUNNER_LLM_BASE_URL"):
        priority, category = model_grade(task, text)
        grader = os.environ.get("JOBRUNNER_LLM_MODEL", "gpt-4o-mini")
    else:
        priority, category = local_grade(text)
        grader = "local-rules"

    def store(conn) -> dict[str, Any]:
        row = conn.execute(
            "INSERT INTO ticket_grades (ticket_id, priority, category, grader, batch_id)"
            " VALUES (%s, %s, %s, %s, %s) ON CONFLICT (ticket_id) DO NOTHING"
            " RETURNING ticket_id", (payload["ticket_id"], priority, category, grader,
                                     task.batch_id)).fetchone()
        return {"stored": row is not None}

    stored = task.once("store-grade", store)
    return {"ticket_id": payload["ticket_id"], "priority": priority, "category": category,
            "stored": bool(stored and stored.get("stored"))}

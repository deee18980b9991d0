-- The ticket-grading example's tables, in the batch's own database (idempotent: the
-- generator runs this at each start).
CREATE TABLE IF NOT EXISTS tickets (
    id         int PRIMARY KEY,
    subject    text NOT NULL,
    body       text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS ticket_grades (
    ticket_id  int PRIMARY KEY REFERENCES tickets (id),
    priority   text NOT NULL,
    category   text NOT NULL,
    grader     text NOT NULL,
    batch_id   text NOT NULL,
    graded_at  timestamptz NOT NULL DEFAULT now()
);

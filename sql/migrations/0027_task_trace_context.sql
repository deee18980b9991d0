-- The trace context of the enqueue that wrote a task (docs/observability.md): the W3C
-- `traceparent`, `tracestate` and `baggage` of its PRODUCER span as a JSON object, NULL
-- when tracing was off. A worker's CONSUMER span of each attempt links to it, so one
-- trace follows a task from its enqueue to its last attempt. Read only when an attempt's
-- span is sampled (task_trace_context, sql/queries/tasks.sql): the claim does not carry it.
-- The archive gets it too, at the same position: retention copies rows with `q.*`.
ALTER TABLE agent_work_queue ADD COLUMN trace_context jsonb;
ALTER TABLE agent_work_queue_archive ADD COLUMN trace_context jsonb;

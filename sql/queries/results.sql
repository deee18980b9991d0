-- Named queries, one file per table family (jobrunner/store/sqlfiles.py loads them all into
-- one namespace). Names are entity then verb; the line under each name says what it does.
-- Parameters use psycopg's %(name)s style; every value is sent as a bound parameter,
-- never formatted into the text. Time always comes from the database's now(), never
-- from a worker's clock.
--
-- Getting results out (jobrunner/features/results.py). The exports run in a transaction of
-- their own through a server-side cursor, so a million rows stream in constant memory.

-- ---------------------------------------------------------------------------------
-- Getting results out (jobrunner/features/results.py). The exports run in a transaction of
-- their own through a server-side cursor, so a million rows stream in constant memory.

-- name: result_export
-- The results of a batch's finished tasks, in task key order.
--
-- The results of a batch's finished tasks, in task key order: the batch's keys in
-- agent_task_key's primary key give that order without a sort (a cursor's plan prefers
-- it), each task then read by its id.
-- The result comes as JSON text and finished_at as ISO 8601 text (the export sets the
-- transaction's TimeZone to UTC): the exporter writes them through without decoding.
-- The reduce task is not a result: its return value is the batch's (batch_result); nor
-- is the generator task.
SELECT k.task_key, q.status::text, q.result::text, q.attempts,
       to_json(q.finished_at) #>> '{}' AS finished_at
FROM agent_task_key k
JOIN agent_work_queue q ON q.id = k.task_id
WHERE k.batch_id = %(batch_id)s AND q.status = 'done'
  AND k.task_key NOT IN ('__reduce__', '__generate__')
ORDER BY k.task_key;

-- name: result_export_errors
-- The errors of a batch's dead (and cancelled) tasks, in task key order.
--
-- The tasks that ended without a result: dead (their last error) and cancelled. (A
-- dead reduce or generator task is the batch's failure, shown by status and top_errors,
-- not a line.)
SELECT q.task_key, q.status::text, q.last_error, q.attempts,
       to_json(q.finished_at) #>> '{}' AS finished_at
FROM agent_work_queue q
WHERE q.batch_id = %(batch_id)s AND q.status IN ('dead', 'cancelled')
  AND q.task_key NOT IN ('__reduce__', '__generate__')
ORDER BY q.task_key;

-- name: result_top_errors
-- A batch's most frequent errors among its dead tasks.
--
-- The most frequent distinct errors of a batch's dead tasks, from the partial index of
-- dead and cancelled rows; only the newest %(sample)s dead tasks are read, so the cost
-- stays bounded on a batch where everything died. Messages are grouped by a pattern
-- in which what differs from task to task is blanked out: lease expiries (worker id,
-- attempt, deadline) become one message; UUIDs, timestamps, hex ids and numbers
-- become placeholders, except HTTP status codes, which tell errors apart. Each group
-- shows the real message of its first task, truncated, and that task's key.
WITH failed AS MATERIALIZED (
    SELECT q.id,
           regexp_replace(regexp_replace(regexp_replace(regexp_replace(regexp_replace(
           regexp_replace(left(coalesce(q.last_error, ''), 1000),
               '^lease expired: .*$', 'lease expired'),
               '[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}',
               '<uuid>', 'g'),
               '[0-9]{4}-[0-9]{2}-[0-9]{2}[T ][0-9:.]+(Z|[+-][0-9:]+)?', '<time>', 'g'),
               '\m(?=[a-f]*[0-9])[0-9a-f]{6,}\M', '<id>', 'g'),
               '(?<!HTTP )(?<![0-9])[0-9]+', '#', 'g'),
               '\s+', ' ', 'g') AS pattern
    FROM agent_work_queue q
    WHERE q.batch_id = %(batch_id)s AND q.status = 'dead'
    ORDER BY q.id DESC
    LIMIT %(sample)s
),
groups AS (
    SELECT pattern, count(*) AS n, min(id) AS first_id
    FROM failed
    GROUP BY pattern
    ORDER BY n DESC, first_id
    LIMIT %(limit)s
)
SELECT g.n AS count, q.task_key AS example_key,
       left(coalesce(q.last_error, ''), %(max_chars)s) AS message
FROM groups g
JOIN agent_work_queue q ON q.id = g.first_id
ORDER BY g.n DESC, g.first_id;

-- Named queries, one file per table family (jobrunner/store/sqlfiles.py loads them all into
-- one namespace). Names are entity then verb; the line under each name says what it does.
--
-- BatchRunSchedules in the database (migration 0029; jobrunner/store/schedules.py): the
-- controller writes each schedule's state and answers the console's trigger requests;
-- the console reads the states and inserts the requests.

-- name: schedule_state_upsert
-- The controller's view of one schedule, written only if something in it changed (a
-- schedule's daemon passes at each start time and on each change of it or its runs).
INSERT INTO agent_schedule AS s (namespace, name, tenant_id, schedule, time_zone, suspend,
                                 concurrency_policy, ready, message, next_run_at,
                                 last_schedule_at, last_successful_at, active_runs)
VALUES (%(namespace)s, %(name)s, %(tenant_id)s, %(schedule)s, %(time_zone)s, %(suspend)s,
        %(concurrency_policy)s, %(ready)s, %(message)s, %(next_run_at)s,
        %(last_schedule_at)s, %(last_successful_at)s, %(active_runs)s)
ON CONFLICT (namespace, name) DO UPDATE
SET tenant_id = excluded.tenant_id, schedule = excluded.schedule,
    time_zone = excluded.time_zone, suspend = excluded.suspend,
    concurrency_policy = excluded.concurrency_policy, ready = excluded.ready,
    message = excluded.message, next_run_at = excluded.next_run_at,
    last_schedule_at = excluded.last_schedule_at,
    last_successful_at = excluded.last_successful_at, active_runs = excluded.active_runs,
    updated_at = now()
WHERE (s.tenant_id, s.schedule, s.time_zone, s.suspend, s.concurrency_policy, s.ready,
       s.message, s.next_run_at, s.last_schedule_at, s.last_successful_at, s.active_runs)
      IS DISTINCT FROM
      (excluded.tenant_id, excluded.schedule, excluded.time_zone, excluded.suspend,
       excluded.concurrency_policy, excluded.ready, excluded.message, excluded.next_run_at,
       excluded.last_schedule_at, excluded.last_successful_at, excluded.active_runs)
RETURNING s.updated_at;

-- name: schedule_state_delete
-- The schedule was deleted: its row goes (its triggers stay, with their outcomes).
DELETE FROM agent_schedule WHERE namespace = %(namespace)s AND name = %(name)s;

-- name: schedule_state_prune
-- The rows, in the namespaces a controller runs schedules in, of schedules it does not run
-- (deleted while it was down: the delete event it missed). The pairs are its registry.
DELETE FROM agent_schedule s
WHERE s.namespace = ANY (%(namespaces)s::text[])
  AND NOT EXISTS (SELECT 1 FROM unnest(%(kept_namespaces)s::text[], %(kept_names)s::text[])
                                AS k(namespace, name)
                  WHERE k.namespace = s.namespace AND k.name = s.name)
RETURNING s.namespace, s.name;

-- name: schedule_state_get
-- One schedule, if the viewer's tenant (NULL: any) may see it.
SELECT s.namespace, s.name, s.tenant_id
FROM agent_schedule s
WHERE s.namespace = %(namespace)s AND s.name = %(name)s
  AND (%(tenant_id)s::text IS NULL OR s.tenant_id = %(tenant_id)s);

-- name: schedule_state_list
-- The schedules of one tenant (NULL: every tenant's), by namespace and name.
SELECT s.namespace, s.name, s.tenant_id, s.schedule, s.time_zone, s.suspend,
       s.concurrency_policy, s.ready, s.message, s.next_run_at, s.last_schedule_at,
       s.last_successful_at, s.active_runs, s.updated_at
FROM agent_schedule s
WHERE %(tenant_id)s::text IS NULL OR s.tenant_id = %(tenant_id)s
ORDER BY s.namespace, s.name
LIMIT %(limit)s;

-- name: schedule_trigger_insert
-- A console admin asks for a run of the schedule now; the controller takes the request.
INSERT INTO agent_schedule_trigger (namespace, name, tenant_id, requested_by)
VALUES (%(namespace)s, %(name)s, %(tenant_id)s, %(requested_by)s)
RETURNING id, requested_at;

-- name: schedule_trigger_take
-- The controller's poll, one per database: the oldest untaken requests in the namespaces
-- whose schedules it runs, locked until its transaction answers them. SKIP LOCKED: a
-- second replica (or a pass still answering) passes them by rather than waiting, and a
-- crash before the answer commits leaves them untaken for the next poll.
SELECT t.id, t.namespace, t.name, t.tenant_id, t.requested_by
FROM agent_schedule_trigger t
WHERE t.taken_at IS NULL AND t.namespace = ANY (%(namespaces)s::text[])
ORDER BY t.id
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED;

-- name: schedule_trigger_answer
-- What became of a request: 'started' and its run, or 'refused' and why. Only an untaken
-- request is answered: a request is taken once.
UPDATE agent_schedule_trigger
SET taken_at = now(), outcome = %(outcome)s, run_name = %(run_name)s, message = %(message)s
WHERE id = %(id)s AND taken_at IS NULL
RETURNING id;

-- name: schedule_trigger_list
-- The newest requests of one tenant's schedules (NULL: every tenant's), with outcomes. A
-- tenant sees the requests made for its schedules, and those its own keys made.
SELECT t.id, t.namespace, t.name, t.tenant_id, t.requested_by, k.name AS key_name,
       t.requested_at, t.taken_at, t.outcome, t.run_name, t.message
FROM agent_schedule_trigger t
LEFT JOIN api_key k ON k.key_id = t.requested_by
LEFT JOIN agent_schedule s ON s.namespace = t.namespace AND s.name = t.name
WHERE %(tenant_id)s::text IS NULL OR t.tenant_id = %(tenant_id)s
   OR s.tenant_id = %(tenant_id)s
ORDER BY t.id DESC
LIMIT %(limit)s;

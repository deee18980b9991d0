-- What each component's role may do (docs/security.md, "Who can do what"), applied by
-- `jobrunner db grant` and again by `jobrunner migrate` after a migration, as the owner
-- (jobrunner/store/roles.py). The names in braces are the roles' and the schema's names,
-- put in as quoted identifiers by the store (psycopg.sql), never as text.
--
-- It converges: everything granted before is revoked first, in the same transaction,
-- so re-running it after a change of this file removes what a role no longer needs.
-- Only the owner owns anything, so only the owner can run DDL (CREATE, ALTER, DROP,
-- TRUNCATE, triggers, policies); no role here gets TRUNCATE, REFERENCES or TRIGGER.

-- Every table, sequence and function of jobrunner's, by name (not ALL ... IN SCHEMA: an
-- application sharing the schema keeps its objects and grants; tests/test_roles.py
-- checks that these lists name every object the migrations make).
REVOKE ALL ON agent_batch, agent_batch_usage, agent_limit, agent_limit_lane,
    agent_limit_lease, agent_pool, agent_pool_stream, agent_pool_tenant,
    agent_pool_tenant_usage, agent_schedule, agent_schedule_trigger, agent_shard_lease,
    agent_task_attempt,
    agent_task_effect, agent_task_key, agent_task_usage, agent_work_queue,
    agent_work_queue_archive, agent_worker_wait, api_batch, api_file, api_file_chunk,
    api_key, console_audit, jobrunner_component_role, jobrunner_schema_migrations,
    jobrunner_tenant_role
FROM {operator}, {worker}, {api}, {readonly};
REVOKE ALL ON SEQUENCE agent_schedule_trigger_id_seq, agent_work_queue_id_seq,
    console_audit_id_seq
FROM {operator}, {worker}, {api}, {readonly};
REVOKE ALL ON FUNCTION
    jobrunner_batch_settled(text, text),
    jobrunner_limit_admit(bigint[]),
    jobrunner_limit_charge(jobrunner_admission[], bigint[]),
    jobrunner_pool_now(text),
    jobrunner_pool_relay(text, text, integer, double precision, double precision),
    jobrunner_pool_set_weight(text, text, double precision),
    jobrunner_pool_start(text, text, integer, text),
    jobrunner_pool_stride(text, text, integer),
    jobrunner_shard_take(text, text),
    jobrunner_task_key_delete(),
    jobrunner_task_key_fixed(),
    jobrunner_task_key_insert(),
    jobrunner_task_key_truncate(),
    jobrunner_wait_key(bigint),
    agent_worker_wait_sleep(bigint[], double precision, boolean),
    jobrunner_leader_key(),
    agent_worker_wait_can_ring(),
    agent_worker_wait_ring(bigint[], integer[], text)
FROM {operator}, {worker}, {api}, {readonly};
-- (USAGE on the schema: granted by its owner, `jobrunner db grant`, sql/queries/roles.sql)

-- Functions are executable by PUBLIC unless revoked. They are all SECURITY INVOKER (they
-- can do only what the caller's table privileges allow) but two of migration 0031:
-- agent_worker_wait_ring cancels only a session sleeping on a waiting row (it holds the
-- row's ASLEEP lock, pg_locks), and agent_worker_wait_can_ring reads role memberships.
REVOKE EXECUTE ON FUNCTION
    jobrunner_batch_settled(text, text),
    jobrunner_limit_admit(bigint[]),
    jobrunner_limit_charge(jobrunner_admission[], bigint[]),
    jobrunner_pool_now(text),
    jobrunner_pool_relay(text, text, integer, double precision, double precision),
    jobrunner_pool_set_weight(text, text, double precision),
    jobrunner_pool_start(text, text, integer, text),
    jobrunner_pool_stride(text, text, integer),
    jobrunner_shard_take(text, text),
    jobrunner_task_key_delete(),
    jobrunner_task_key_fixed(),
    jobrunner_task_key_insert(),
    jobrunner_task_key_truncate(),
    jobrunner_wait_key(bigint),
    agent_worker_wait_sleep(bigint[], double precision, boolean),
    jobrunner_leader_key(),
    agent_worker_wait_can_ring(),
    agent_worker_wait_ring(bigint[], integer[], text)
FROM PUBLIC;
-- (The tenants' bindings, jobrunner_tenant_role: no component reads them. The row
-- policies hold each bound role's tenants as constants, sql/grants/tenant_policies.sql.)

-- ---------------------------------------------------------------------------------------
-- worker: claim, ack, fail, heartbeat, release, expiry; effects (task.once), usage and
-- budgets; reduce (its result, and enqueueing its task); generators (enqueueing their
-- batch's tasks); a pool's fair-share clocks; flow control's lanes, slots and 429 pauses.
-- Nothing of the Batch API or the console; no DELETE of tasks, batches, effects or usage.
GRANT SELECT, INSERT, UPDATE ON agent_work_queue, agent_batch, agent_task_effect,
    agent_task_usage, agent_batch_usage, agent_pool, agent_pool_stream,
    agent_pool_tenant_usage TO {worker};
GRANT SELECT, INSERT ON agent_task_key TO {worker};
-- (an attempt that ends without an ack is written down by the statement that ends it)
GRANT INSERT ON agent_task_attempt TO {worker};
GRANT SELECT ON agent_pool_tenant, jobrunner_schema_migrations TO {worker};
GRANT SELECT, UPDATE ON agent_limit, agent_limit_lane TO {worker};
GRANT SELECT, INSERT, DELETE ON agent_limit_lease TO {worker};
GRANT USAGE ON SEQUENCE agent_work_queue_id_seq TO {worker};
-- its own waiting row; taking other workers' when it enqueues (a reduce, a generator's
-- chunk); the leader's sweep of dead workers' rows (migration 0030)
GRANT SELECT, INSERT, UPDATE, DELETE ON agent_worker_wait TO {worker};
GRANT EXECUTE ON FUNCTION
    jobrunner_batch_settled(text, text),
    jobrunner_limit_admit(bigint[]),
    jobrunner_limit_charge(jobrunner_admission[], bigint[]),
    jobrunner_pool_now(text),
    jobrunner_pool_relay(text, text, integer, double precision, double precision),
    jobrunner_pool_start(text, text, integer, text),
    jobrunner_pool_stride(text, text, integer),
    jobrunner_shard_take(text, text),
    jobrunner_wait_key(bigint),
    agent_worker_wait_sleep(bigint[], double precision, boolean),
    jobrunner_leader_key(),
    agent_worker_wait_can_ring(),
    agent_worker_wait_ring(bigint[], integer[], text)
TO {worker};

-- ---------------------------------------------------------------------------------------
-- operator (the controller, and the CLI's administration: enqueue, status, cancel,
-- requeue, retention, limits, budgets, pools' weights): every queue table, no API table.
GRANT SELECT, INSERT, UPDATE, DELETE ON agent_work_queue, agent_batch, agent_task_key,
    agent_task_usage, agent_batch_usage, agent_limit, agent_limit_lane, agent_limit_lease,
    agent_pool, agent_pool_stream, agent_pool_tenant, agent_pool_tenant_usage TO {operator};
GRANT SELECT, DELETE ON agent_task_effect TO {operator};
GRANT SELECT, INSERT, DELETE ON agent_task_attempt TO {operator};
GRANT SELECT, INSERT, DELETE ON agent_work_queue_archive TO {operator};
GRANT SELECT ON jobrunner_schema_migrations TO {operator};
GRANT USAGE ON SEQUENCE agent_work_queue_id_seq TO {operator};
-- an enqueue wakes the waiting workers it has tasks for by taking their rows (FOR UPDATE
-- SKIP LOCKED, which needs UPDATE: two enqueues take different workers)
GRANT SELECT, UPDATE, DELETE ON agent_worker_wait TO {operator};
-- BatchRunSchedules as last seen (written when they change, deleted with them), and the
-- console's trigger requests, each taken once and answered (migration 0029).
GRANT SELECT, INSERT, UPDATE, DELETE ON agent_schedule TO {operator};
GRANT SELECT, UPDATE ON agent_schedule_trigger TO {operator};
GRANT EXECUTE ON FUNCTION
    jobrunner_batch_settled(text, text),
    jobrunner_limit_admit(bigint[]),
    jobrunner_limit_charge(jobrunner_admission[], bigint[]),
    jobrunner_pool_now(text),
    jobrunner_pool_relay(text, text, integer, double precision, double precision),
    jobrunner_pool_set_weight(text, text, double precision),
    jobrunner_pool_start(text, text, integer, text),
    jobrunner_pool_stride(text, text, integer),
    jobrunner_shard_take(text, text),
    agent_worker_wait_ring(bigint[], integer[], text)
TO {operator};

-- ---------------------------------------------------------------------------------------
-- api (`jobrunner serve`: the Batch API and the console): its own tables; enqueueing
-- its batches' tasks, reading their progress and results, cancelling them; the
-- console's admin actions (requeue dead tasks, cancel, budgets, limits' pauses, pool
-- weights) with their audit rows.
GRANT SELECT, INSERT, UPDATE, DELETE ON api_key, api_file, api_file_chunk, api_batch
    TO {api};
GRANT SELECT, INSERT ON console_audit TO {api};
GRANT USAGE ON SEQUENCE console_audit_id_seq TO {api};
-- Schedules: read what the controller wrote of them; ask for a run ("Trigger now") by
-- inserting a request the controller takes. No Kubernetes access, and no UPDATE of a
-- request: its outcome is the controller's to write.
GRANT SELECT ON agent_schedule TO {api};
GRANT SELECT, INSERT ON agent_schedule_trigger TO {api};
GRANT USAGE ON SEQUENCE agent_schedule_trigger_id_seq TO {api};
GRANT SELECT, INSERT, UPDATE ON agent_work_queue, agent_batch, agent_task_usage,
    agent_batch_usage, agent_pool, agent_pool_stream TO {api};
GRANT SELECT, INSERT ON agent_task_key TO {api};
GRANT SELECT ON agent_task_effect, agent_task_attempt, agent_limit, agent_limit_lane,
    agent_pool_tenant, agent_pool_tenant_usage, jobrunner_schema_migrations TO {api};
-- The console's admin actions on flow control and pools: pause and resume a limit (its
-- block only, not its rates), set a tenant's weight in a pool.
GRANT UPDATE (blocked_until, updated_at) ON agent_limit TO {api};
GRANT INSERT, UPDATE ON agent_pool_tenant TO {api};
GRANT USAGE ON SEQUENCE agent_work_queue_id_seq TO {api};
-- an enqueue wakes the waiting workers it has tasks for by taking their rows
GRANT SELECT, UPDATE, DELETE ON agent_worker_wait TO {api};
GRANT EXECUTE ON FUNCTION
    jobrunner_batch_settled(text, text),
    jobrunner_pool_now(text),
    jobrunner_pool_relay(text, text, integer, double precision, double precision),
    jobrunner_pool_set_weight(text, text, double precision),
    jobrunner_pool_start(text, text, integer, text),
    jobrunner_pool_stride(text, text, integer),
    agent_worker_wait_ring(bigint[], integer[], text)
TO {api};

-- ---------------------------------------------------------------------------------------
-- readonly (metrics, a read-only console, dashboards): reads every table but the API
-- keys' hashes and the files' raw bytes.
GRANT SELECT ON agent_work_queue, agent_work_queue_archive, agent_batch, agent_task_key,
    agent_task_effect, agent_task_usage, agent_task_attempt, agent_batch_usage, agent_limit,
    agent_limit_lane, agent_limit_lease, agent_pool, agent_pool_stream, agent_pool_tenant,
    agent_pool_tenant_usage, agent_schedule, agent_schedule_trigger, agent_shard_lease,
    api_file, api_batch, console_audit, jobrunner_schema_migrations TO {readonly};
GRANT EXECUTE ON FUNCTION
    jobrunner_batch_settled(text, text),
    jobrunner_pool_now(text),
    jobrunner_pool_stride(text, text, integer)
TO {readonly};

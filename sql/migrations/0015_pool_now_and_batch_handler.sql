-- Two changes for worker pools on Kubernetes (issue 18).
--
-- The pool's virtual time now, read at the moment the pool's lock is held rather than at
-- the start of the enqueue's transaction (issue 18, found by the WorkerPool e2e test).
--
-- 0014 called a pending task "due" when run_after <= now(), the transaction's start. Two
-- runs enqueued at once into one pool (two BatchRuns applied together): the second's
-- transaction starts, the first commits its tasks (run_after = its own, later, now()),
-- the second takes the pool's lock and finds none of them due, so the pool's time now fell
-- back to the largest tag laid and the second tenant was laid behind the first's whole
-- backlog (measured: tenant B got no claim until A's 16 tasks were done). With the clock
-- read after the lock, every committed enqueue's tasks are due (run_after <= its commit
-- < this read), and a task waiting out a retry backoff still is not.
CREATE OR REPLACE FUNCTION jobrunner_pool_now(p_pool text) RETURNS float8
LANGUAGE sql VOLATILE AS $$
    SELECT coalesce(
        (SELECT q.vtag FROM agent_work_queue q
         WHERE q.pool = p_pool AND q.status = 'pending' AND q.run_after <= clock_timestamp()
         ORDER BY q.vtag, q.id LIMIT 1),
        (SELECT p.vclock FROM agent_pool p WHERE p.pool = p_pool),
        0)
$$;

-- Several handlers per pool (a WorkerPool's spec.handlers): a pool batch records the
-- handler its tasks run with, set at its first enqueue that names one and never changed;
-- a pool worker serving several handlers runs each task with its batch's (NULL: the
-- worker's only handler; jobrunner/pool_handlers.py).
ALTER TABLE agent_batch ADD COLUMN handler text;

-- The OpenAI Files and Batches API (jobrunner/store/batch_api.py, migration 0019): keys,
-- files and their chunks, batches. Every statement names the tenant of the key that
-- asks, so a key never reads or changes another tenant's rows.

-- name: api_key_insert
-- Store a new key's hash and its console role.
INSERT INTO api_key (key_id, tenant_id, name, key_hash, role)
VALUES (%(key_id)s, %(tenant_id)s, %(name)s, %(key_hash)s, %(role)s)
RETURNING key_id, tenant_id, name, role, created_at;

-- name: api_key_find
-- The tenant and console role of a live key, by the hash of the key presented.
SELECT key_id, tenant_id, role FROM api_key WHERE key_hash = %(key_hash)s AND revoked_at IS NULL;

-- name: api_key_revoke
-- Revoke a key (at once: every request looks its key up).
UPDATE api_key SET revoked_at = coalesce(revoked_at, now()) WHERE key_id = %(key_id)s
RETURNING key_id, tenant_id;

-- name: api_key_list
-- Keys (never their hashes), of one tenant or all.
SELECT key_id, tenant_id, name, role, created_at, revoked_at FROM api_key
WHERE %(tenant_id)s::text IS NULL OR tenant_id = %(tenant_id)s
ORDER BY created_at, key_id;

-- name: api_file_insert
-- A new file, empty until its chunks are written in the same transaction.
INSERT INTO api_file (file_id, tenant_id, filename, purpose, expires_at, idempotency_key)
VALUES (%(file_id)s, %(tenant_id)s, %(filename)s, %(purpose)s,
        now() + make_interval(secs => %(expires_after)s::float8), %(idempotency_key)s);

-- name: api_file_chunk_insert
-- One chunk of a file's content.
INSERT INTO api_file_chunk (file_id, seq, data) VALUES (%(file_id)s, %(seq)s, %(data)s);

-- name: api_file_finish
-- The file's purpose, size and line count, once its last chunk is written.
UPDATE api_file SET purpose = %(purpose)s, bytes = %(bytes)s, lines = %(lines)s WHERE file_id = %(file_id)s
RETURNING file_id, tenant_id, filename, purpose, bytes, lines, created_at, expires_at;

-- name: api_file_get
-- A live file of the tenant.
SELECT file_id, tenant_id, filename, purpose, bytes, lines, created_at, expires_at
FROM api_file
WHERE file_id = %(file_id)s AND tenant_id = %(tenant_id)s
  AND (expires_at IS NULL OR expires_at > now());

-- name: api_file_by_idempotency
-- The file an earlier request with the same Idempotency-Key created.
SELECT file_id FROM api_file
WHERE tenant_id = %(tenant_id)s AND idempotency_key = %(idempotency_key)s;

-- name: api_file_list
-- A page of the tenant's live files, newest first, after the file `after` (if given).
SELECT file_id, tenant_id, filename, purpose, bytes, lines, created_at, expires_at
FROM api_file f
WHERE f.tenant_id = %(tenant_id)s
  AND (f.expires_at IS NULL OR f.expires_at > now())
  AND (%(purpose)s::text IS NULL OR f.purpose = %(purpose)s)
  AND (%(after)s::text IS NULL OR (f.created_at, f.file_id) <
       (SELECT a.created_at, a.file_id FROM api_file a
        WHERE a.file_id = %(after)s AND a.tenant_id = %(tenant_id)s))
ORDER BY f.created_at DESC, f.file_id DESC
LIMIT %(limit)s;

-- name: api_file_chunk_get
-- One chunk of a file, by its number (none past the last).
SELECT data FROM api_file_chunk WHERE file_id = %(file_id)s AND seq = %(seq)s;

-- name: api_file_delete
-- Delete a file of the tenant and its chunks.
DELETE FROM api_file WHERE file_id = %(file_id)s AND tenant_id = %(tenant_id)s
RETURNING file_id;

-- name: api_file_delete_expired
-- Delete a few expired files (their chunks go with them).
DELETE FROM api_file WHERE file_id IN (
    SELECT file_id FROM api_file WHERE expires_at <= now()
    ORDER BY expires_at LIMIT %(limit)s FOR UPDATE SKIP LOCKED)
RETURNING file_id;

-- name: api_batch_insert
-- A new batch, in progress: its tasks are enqueued in the same transaction.
INSERT INTO api_batch (batch_id, tenant_id, input_file_id, endpoint, completion_window,
                       metadata, model, status, total, in_progress_at, expires_at,
                       idempotency_key)
VALUES (%(batch_id)s, %(tenant_id)s, %(input_file_id)s, %(endpoint)s, %(completion_window)s,
        %(metadata)s, %(model)s, 'in_progress', %(total)s, now(),
        now() + make_interval(secs => %(window_seconds)s::float8), %(idempotency_key)s);

-- name: api_batch_get
-- A batch of the tenant.
SELECT * FROM api_batch WHERE batch_id = %(batch_id)s AND tenant_id = %(tenant_id)s;

-- name: api_batch_by_idempotency
-- The batch an earlier request with the same Idempotency-Key created.
SELECT batch_id FROM api_batch
WHERE tenant_id = %(tenant_id)s AND idempotency_key = %(idempotency_key)s;

-- name: api_batch_list
-- A page of the tenant's batches, newest first, after the batch `after` (if given).
SELECT * FROM api_batch b
WHERE b.tenant_id = %(tenant_id)s
  AND (%(after)s::text IS NULL OR (b.created_at, b.batch_id) <
       (SELECT a.created_at, a.batch_id FROM api_batch a
        WHERE a.batch_id = %(after)s AND a.tenant_id = %(tenant_id)s))
ORDER BY b.created_at DESC, b.batch_id DESC
LIMIT %(limit)s;

-- name: api_batch_cancel
-- Ask to cancel a batch of the tenant that has not ended; returns it (as it is now).
UPDATE api_batch SET status = 'cancelling', cancelling_at = now()
WHERE batch_id = %(batch_id)s AND tenant_id = %(tenant_id)s AND status = 'in_progress'
RETURNING batch_id;

-- name: api_batch_open
-- Batches that have not ended, for the sweeper (expiry, finalizing).
SELECT batch_id FROM api_batch
WHERE status IN ('in_progress', 'finalizing', 'cancelling')
ORDER BY expires_at LIMIT %(limit)s;

-- name: api_batch_lock
-- Lock a batch that has not ended for one advance; nothing if another replica holds it.
SELECT *, expires_at <= now() AS due FROM api_batch
WHERE batch_id = %(batch_id)s AND status IN ('in_progress', 'finalizing', 'cancelling')
FOR UPDATE SKIP LOCKED;

-- name: api_batch_expire
-- The window ended: the batch finalizes, with what finished.
UPDATE api_batch SET status = 'finalizing', expired_at = now(),
                     finalizing_at = coalesce(finalizing_at, now())
WHERE batch_id = %(batch_id)s;

-- name: api_batch_finalizing
-- Every task ended: the batch finalizes (its output files are written).
UPDATE api_batch SET status = 'finalizing', finalizing_at = coalesce(finalizing_at, now())
WHERE batch_id = %(batch_id)s;

-- name: api_batch_end
-- The batch ended: its status, counts and files.
UPDATE api_batch
SET status = %(status)s, completed = %(completed)s, failed = %(failed)s,
    output_file_id = %(output_file_id)s, error_file_id = %(error_file_id)s,
    finalizing_at = coalesce(finalizing_at, now()),
    completed_at = CASE WHEN %(status)s = 'completed' THEN now() END,
    cancelled_at = CASE WHEN %(status)s = 'cancelled' THEN now() END
WHERE batch_id = %(batch_id)s;

-- name: api_batch_leased
-- Whether a batch still has tasks running.
SELECT EXISTS (SELECT 1 FROM agent_work_queue
               WHERE tenant_id = %(tenant_id)s AND batch_id = %(batch_id)s
                 AND status = 'leased') AS leased;

-- name: api_ping
-- The readiness probe's round trip.
SELECT 1;

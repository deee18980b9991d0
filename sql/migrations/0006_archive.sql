-- Optional destination of `jobrunner retention --archive`: same columns, no indexes
-- beyond the key, never read by the hot path.
CREATE TABLE agent_work_queue_archive (LIKE agent_work_queue INCLUDING DEFAULTS);
ALTER TABLE agent_work_queue_archive ADD PRIMARY KEY (id);

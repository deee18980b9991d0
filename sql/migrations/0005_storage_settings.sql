-- The queue table is small-hot / large-cold: a few thousand rows change state per
-- second while millions of finished rows sit still. Vacuum it far more eagerly than
-- the default 20 % scale factor so dead index entries of claimed rows are removed
-- before claims have to step over them, and leave room on each page for the
-- heartbeat/ack updates.
ALTER TABLE agent_work_queue SET (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_limit = 2000,
    fillfactor = 80
);
ALTER TABLE agent_shard_lease SET (
    autovacuum_vacuum_scale_factor = 0.0,
    autovacuum_vacuum_threshold = 500
);

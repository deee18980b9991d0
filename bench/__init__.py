"""Benchmarks: jobrunner side by side with pgqueuer, procrastinate and pgbench, on one
embedded PostgreSQL server in one run.  Entry point: ``python -m bench`` (see
``bench/README.md`` and ``docs/performance.md``)."""

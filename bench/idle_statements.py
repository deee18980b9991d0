"""``python -m bench.idle_statements [PODS] [WINDOW]``: what a waiting fleet's statements
cost the server, one line per statement (issue 30).

PODS simulated pods of this tree (bench/fleet_child.py, as bench.idle_fleet runs them:
queue connections through PgBouncer in transaction pooling, one direct notifier per pod)
wait on an empty batch. After they settle, pg_stat_statements (planning tracked) is reset
and read again WINDOW seconds later, while the server's CPU is measured over the same
window: the split of the per-pod cost by statement, and what is left outside statements
(protocol, transactions, background processes). The server's own idle CPU is not
subtracted (bench.idle_fleet's figure does; it is about zero).

    python -m bench.idle_statements 200 60
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import psycopg

from bench import env
from bench.idle_fleet import Bouncer, Fleet, _ready, _steady, server_cores
from bench.systems import Jobrunner

TOP = """SELECT calls, round((total_plan_time + total_exec_time)::numeric, 1) AS ms,
       round(((total_plan_time + total_exec_time) / greatest(calls, 1))::numeric, 3) AS per,
       left(regexp_replace(query, '\\s+', ' ', 'g'), 110) AS text
FROM pg_stat_statements ORDER BY total_plan_time + total_exec_time DESC LIMIT 15"""


def main(pods: int, window: float) -> None:
    server = env.Server()
    server.start()
    with psycopg.connect(server.admin_dsn, autocommit=True) as c:
        c.execute("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
        c.execute("ALTER SYSTEM SET pg_stat_statements.track_planning = on")
        c.execute("ALTER SYSTEM SET max_connections = 2600")
    server.pg.restart()
    try:
        jr = Jobrunner(server)
        jr.reset()
        with psycopg.connect(jr.dsn, autocommit=True) as c:
            c.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        bouncer = Bouncer(server, jr.db)
        fleet = Fleet("this", "jobrunner", jr.db, bouncer.dsn, listen_dsn=jr.dsn, pooled=True)
        procs = fleet.start(pods, Path(tempfile.mkdtemp()))
        with env.running(procs), psycopg.connect(server.admin_dsn, autocommit=True) as mon:
            env.wait_until(lambda: _ready(procs), 300, 0.5, "fleet")
            _steady(mon, jr.db)
            time.sleep(10)
            with psycopg.connect(jr.dsn, autocommit=True) as c:
                c.execute("SELECT pg_stat_statements_reset()")
            cores, bouncer_cores = server_cores(server, mon.info.backend_pid, window, bouncer)
            print(f"{pods} pods over {window:.0f} s: server {cores * 1000 / pods:.3f} ms/s per "
                  f"pod; PgBouncer {bouncer_cores * 1000 / pods:.3f} ms/s per pod")
            with psycopg.connect(jr.dsn, autocommit=True) as c:
                for calls, ms, per, text in c.execute(TOP).fetchall():
                    print(f"{calls:6d} calls {ms:9} ms {per:7} ms/call  {text}")
        bouncer.stop()
    finally:
        server.stop()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200,
         float(sys.argv[2]) if len(sys.argv) > 2 else 60.0)

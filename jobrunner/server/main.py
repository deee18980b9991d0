"""`jobrunner serve`: uvicorn on one socket. --reuse-port lets several replicas on one
host share a port (SO_REUSEPORT), as a Service spreads connections over pods."""

from __future__ import annotations

import socket

import uvicorn

from jobrunner.server.app import create_app
from jobrunner.server.context import Settings


def serve(settings: Settings, host: str = "127.0.0.1", port: int = 8000, *,
          reuse_port: bool = False, log_level: str = "info") -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(1024)
    config = uvicorn.Config(create_app(settings), log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=20, proxy_headers=False)
    uvicorn.Server(config).run(sockets=[sock])

"""A silent network partition between workers and their database, on one machine.

The test creates a network namespace of its own (only its loopback, 127.0.0.1, no other
address) and runs the workers in it. They reach the database through a relay: a process
whose listening socket is in the namespace (127.0.0.1:port there) and whose connections
to the database server are made from the host's namespace. A partition is an nftables
rule in the namespace that DROPs every packet to or from the relay's port: nothing is
closed and no reset is sent, as when a node or a link is lost, so the workers' kernel
retransmits into the void until the connection's own timeouts (keepalives,
tcp_user_timeout) give up. Removing the rule heals it.

The relay side facing the workers has the keepalives and user timeout docs/failover.md
recommends for the server (a server left waiting on a vanished client would keep its
transaction, and the locks of it, for hours), and closes the database side when the
worker side fails, as the server would.

Run as `python -m tests.support.netns relay NAMESPACE HOST PORT`: prints the port it
listens on in NAMESPACE, then relays until killed.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

CLONE_NEWNET = 0x40000000
TABLE = "jobrunner_partition"


def available() -> str | None:
    """Why a partition cannot be made here, or None."""
    if os.geteuid() != 0:
        return "a network namespace and nftables rules need root"
    for tool in ("ip", "nft"):
        if not shutil.which(tool):
            return f"`{tool}` is not installed (iproute2, nftables)"
    return None


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


class Partitionable:
    def __init__(self, host: str, port: int) -> None:
        self.name = f"jr-part-{secrets.token_hex(3)}"
        self.host, self.port = host, port
        self.relay: subprocess.Popen | None = None
        self.listen_port = 0

    def start(self) -> Partitionable:
        _run("ip", "netns", "add", self.name)
        _run("ip", "netns", "exec", self.name, "ip", "link", "set", "lo", "up")
        repo = Path(__file__).resolve().parent.parent.parent
        self.relay = subprocess.Popen(
            [sys.executable, "-m", "tests.support.netns", "relay", self.name, self.host,
             str(self.port)], cwd=repo, stdout=subprocess.PIPE, text=True)
        self.listen_port = int(self.relay.stdout.readline())
        return self

    def prefix(self) -> list[str]:
        """Run a command inside the namespace: prefix() + argv."""
        return ["ip", "netns", "exec", self.name]

    def drop(self) -> None:
        p = str(self.listen_port)
        for rule in (f"add table inet {TABLE}",
                     f"add chain inet {TABLE} input {{ type filter hook input priority 0 ; }}",
                     f"add rule inet {TABLE} input tcp dport {p} drop",
                     f"add rule inet {TABLE} input tcp sport {p} drop"):
            _run("ip", "netns", "exec", self.name, "nft", *rule.split())

    def heal(self) -> None:
        _run("ip", "netns", "exec", self.name, "nft", "delete", "table", "inet", TABLE)

    def stop(self) -> None:
        if self.relay is not None and self.relay.poll() is None:
            self.relay.kill()
            self.relay.wait(10)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)


# -- the relay process ---------------------------------------------------------------
def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns")


def _server_side_timeouts(sock: socket.socket) -> None:
    # docs/failover.md's server settings: probe an idle client after 5 s, 3 probes 2 s
    # apart; give up on unacknowledged data after 10 s
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 2)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 10_000)


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


def relay(namespace: str, host: str, port: int) -> None:
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    _setns(target)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    _setns(home)  # (the listener stays in the namespace; new sockets are the host's)
    print(listener.getsockname()[1], flush=True)
    while True:
        client, _ = listener.accept()
        _server_side_timeouts(client)
        server = socket.create_connection((host, port))
        for a, b in ((client, server), (server, client)):
            threading.Thread(target=_pipe, args=(a, b), daemon=True).start()


if __name__ == "__main__":
    if sys.argv[1:2] == ["relay"]:
        relay(sys.argv[2], sys.argv[3], int(sys.argv[4]))

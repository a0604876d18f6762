"""Rendezvous ports, with the standard library only (launch/common.sh runs it before anything heavy):

    python -m training.parallel.spawn          # prints a free port (launch/common.sh's free_port)
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _below_ephemeral() -> range:
    """Ports below the kernel's ephemeral range (Linux: 32768-60999): the ports it hands to every outgoing
    connection and bind(0) (another job's gloo sockets, a browser) come from that range, so a port picked there
    can be taken between our check and torchrun's bind; below it only explicit binds compete."""
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(max(1024, low - 12288), low)


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port free on this host now (for a local rendezvous: launch scripts, tools, the test harness): a
    random one below the ephemeral range (see _below_ephemeral), else one the kernel picks."""
    ports = _below_ephemeral()
    for _ in range(64 if len(ports) > 1024 else 0):
        if _is_free(port := random.choice(ports)):
            return port
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def port_problem(port: int) -> str | None:
    """Why MASTER_PORT=port cannot be used on this host (it is taken), or None."""
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError as err:
            return (f"MASTER_PORT={port} is not free on this host ({err.strerror}): "
                    f"pick another with MASTER_PORT=... or leave it unset for a free one")
    return None


if __name__ == "__main__":
    print(free_port())

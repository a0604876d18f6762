"""Rendezvous ports, with the standard library only (launch/common.sh runs it before anything heavy):

    python -m training.parallel.spawn          # prints a free port (launch/common.sh's free_port)
"""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port free on this host now (for a local rendezvous: launch scripts, tools, the test harness)."""
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

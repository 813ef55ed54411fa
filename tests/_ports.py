"""Ports for the process groups the tests start.

Why not the kernel's pick (bind to port 0): it hands out a port from the ephemeral range, the very range gloo's pair
connections and every other client socket on the host take theirs from. A launch picks its ports at its start and
binds some of them minutes later (a module's second world), and a port picked so was, now and then, taken by then: a
rank's store connection reset, and the launch waited out its timeout. Ports below that range are handed to nobody
unasked; one picked at random there and free now stays free.
"""

from __future__ import annotations

import random
import socket


def _below_ephemeral() -> range:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default start; macOS's is 49152
    return range(10000, max(low, 10001))


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports below the ephemeral range, each free on every interface when picked."""
    ports: list[int] = []
    candidates = _below_ephemeral()
    for _ in range(1000):
        port = random.choice(candidates)
        if port in ports:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise RuntimeError(f"Found {len(ports)} of {n} free ports below the ephemeral range in 1000 tries.")


def free_port() -> int:
    """One port of :func:`free_ports`."""
    return free_ports(1)[0]

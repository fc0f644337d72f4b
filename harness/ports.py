"""Free TCP ports for the servers tests and benchmarks start."""

from __future__ import annotations

import functools
import random
import socket
from pathlib import Path

LOWEST = 10000  # below: well-known and registered services' ports
_given: set[int] = set()


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now, never the same twice in this process.

    Taken below the kernel's ephemeral range when there is room: the kernel hands ports from that range to every
    outgoing connection and every bind to port 0 (gloo's stores, clients of the servers already running), so a
    port found free there can be someone else's before the server told to use it binds it (seen: a test's
    `strata serve` failing on "Address already in use" while the other test worker's vLLM engines started)."""
    low = _ephemeral_low()
    if low - LOWEST < 1000:  # no room below the range: let the kernel pick, as before
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]
    while True:
        port = random.randrange(LOWEST, low)
        if port in _given:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port


@functools.cache
def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default

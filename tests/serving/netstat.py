"""Listening TCP sockets of this machine, read from /proc (no tools needed)."""

from __future__ import annotations

LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}


def listening_sockets() -> set[tuple[str, int]]:
    found = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(path).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if parts[3] == "0A":  # LISTEN
                address, port = parts[1].rsplit(":", 1)
                found.add((address, int(port, 16)))
    return found

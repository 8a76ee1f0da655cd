"""systemd ``Type=notify-reload`` support: READY=1, RELOADING=1 (+MONOTONIC_USEC), STOPPING=1.

A datagram to $NOTIFY_SOCKET per sd_notify(3); a no-op when not run by systemd.
"""

from __future__ import annotations

import os
import socket

__all__ = ["notify"]


def notify(*fields: str) -> bool:
    """Send ``fields`` (``KEY=value`` lines) to systemd. False when not under systemd or on failure."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # abstract namespace socket
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall("\n".join(fields).encode())
    except OSError:
        return False
    return True

"""sd_notify: READY, STOPPING, STATUS and WATCHDOG datagrams to $NOTIFY_SOCKET."""

from __future__ import annotations

import logging
import os
import socket

__all__ = ["notify", "watchdog_interval"]

logger = logging.getLogger(__name__)


def notify(message: str) -> bool:
    """Send one sd_notify message; a no-op (False) when not run by systemd."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            # Called on the event loop: a receiver that stops reading must never block it
            # (a full socket buffer drops this message, BlockingIOError below).
            sock.setblocking(False)
            sock.connect(address)
            sock.send(message.encode())
    except OSError as exc:
        logger.warning("sd_notify %r failed: %s", message, exc)
        return False
    return True


def watchdog_interval() -> float | None:
    """Half the watchdog period systemd asked for (WATCHDOG_USEC), or None."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return max(0.1, int(usec) / 2_000_000)
    except ValueError:
        return None

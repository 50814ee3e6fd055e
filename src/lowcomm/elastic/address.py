"""Addresses of an elastic run's services: `--lighthouse HOST:PORT` read and checked, and
whether a lighthouse or store answers at all (a refused connection is one line, not a
30 s wait inside torchft's client)."""
from __future__ import annotations

import socket
from urllib.parse import urlsplit

from ..errors import UsageError

CONNECT_S = 5.0


def parse_lighthouse(value: str) -> str:
    """`--lighthouse HOST:PORT` (or http://HOST:PORT) -> the URL torchft's client takes."""
    text = value.strip()
    url = text if "://" in text else f"http://{text}"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "http" or not parts.hostname or port is None or parts.path not in ("", "/"):
        raise UsageError(f"--lighthouse must be HOST:PORT (a running torchft lighthouse), got '{value}'")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"http://{host}:{port}"


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    return parts.hostname or "", parts.port or 0


def check_reachable(url: str, what: str) -> None:
    """UsageError `what: ...` when nothing accepts a connection at `url`'s host and port."""
    host, port = host_port(url)
    try:
        socket.create_connection((host, port), timeout=CONNECT_S).close()
    except OSError as e:
        raise UsageError(f"{what}: nothing answers at {host}:{port} ({e.strerror or e})") from None


class UsedLighthouse:
    """A running lighthouse given with --lighthouse: the launcher uses it, and leaves it running
    at its end (it is not the launcher's to stop)."""

    def __init__(self, value: str):
        self.url = parse_lighthouse(value)

    def address(self) -> str:
        return self.url

    def shutdown(self) -> None:
        pass

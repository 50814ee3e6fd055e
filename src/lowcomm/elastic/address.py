"""Addresses of an elastic run's services: `--lighthouse HOST:PORT` read and checked, and
whether a lighthouse or store answers at all (a refused connection is one line, not a
30 s wait inside torchft's client), and whether what answers is a torchft lighthouse.

A torchft lighthouse serves, beside its gRPC, a dashboard over plain HTTP on the same port:
`/status` says what its next quorum waits for ("New quorum not ready, only have 2 participants,
need min_replicas 5 ..."). Reading it asks the lighthouse nothing that changes its state (a
heartbeat or a quorum request would count as a member), so it is the check up front, and what a
worker quotes when a quorum is long in coming.
"""
from __future__ import annotations

import html
import re
import socket
import urllib.error
import urllib.request
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


def lighthouse_status(url: str, timeout_s: float = CONNECT_S) -> str:
    """The lighthouse's own line on its next quorum ('' when it says none); OSError when what
    answers at `url` is not a torchft lighthouse, or does not answer over HTTP within `timeout_s`."""
    try:
        with urllib.request.urlopen(f"{url}/status", timeout=timeout_s) as reply:
            page = reply.read(1 << 16).decode("utf-8", "replace")
    except (urllib.error.URLError, ValueError, UnicodeError, socket.timeout) as e:
        raise OSError(f"no lighthouse status page ({getattr(e, 'reason', None) or e})") from None
    except Exception as e:  # http.client's own errors: a service that does not speak HTTP
        raise OSError(f"it does not answer as a web server ({type(e).__name__})") from None
    if "quorum" not in page.lower():
        raise OSError("its /status page is not a torchft lighthouse's")
    found = re.search(r"Next quorum status:\s*([^<\n]*)", page)
    return html.unescape(found.group(1)).strip() if found else ""


def min_replicas(status: str) -> int | None:
    """The members a lighthouse waits for before its first quorum, as its status line says."""
    found = re.search(r"need min_replicas (\d+)", status)
    return int(found.group(1)) if found else None


def check_lighthouse(url: str, what: str, members: int | None = None) -> None:
    """UsageError `what: ...` unless a torchft lighthouse answers at `url`; with `members` (the
    most the run's first quorum can hold), also when it waits for more than that."""
    check_reachable(url, what)
    host, port = host_port(url)
    try:
        status = lighthouse_status(url)
    except OSError as e:
        raise UsageError(f"{what}: what answers at {host}:{port} is not a torchft lighthouse ({e})") from None
    need = min_replicas(status)
    if members is not None and need is not None and need > members:
        raise UsageError(f"{what}: the lighthouse there waits for {need} members (its --min_replicas) before any "
                         f"quorum, and this run has {members}: it would wait for ever")


class UsedLighthouse:
    """A running lighthouse given with --lighthouse: the launcher uses it, and leaves it running
    at its end (it is not the launcher's to stop)."""

    def __init__(self, value: str):
        self.url = parse_lighthouse(value)

    def address(self) -> str:
        return self.url

    def shutdown(self) -> None:
        pass

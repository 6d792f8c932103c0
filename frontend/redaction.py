"""What the HTTP side shows of the inside: death reasons without addresses, access-log lines without query strings.

An unauthenticated `/health` must not map the cluster (a Ray actor's node IP, a socket's port), and the access log
must not keep what a query string carries (the dashboard's `?token=KEY`). The engine's own log keeps the details for
operators.
"""

from __future__ import annotations

import re

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

ADDRESS = "<address>"
_ADDRESS_FORMS = [
    r"\b[a-zA-Z][a-zA-Z0-9+.-]*://\S+",  # tcp://host:port, ipc:///path, http://...
    r"\[[0-9a-fA-F:.%]+\](?::\d+)?",  # [IPv6]:port
    r"(?<![\w:.])(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b",  # IPv4[:port]
    r"(?<![\w:])(?:[0-9a-fA-F]{0,4}:){2,7}[0-9a-fA-F]{0,4}(?:%\w+)?(?![\w:])",  # bare IPv6, :: forms included
]
_ADDRESS_PATTERNS = re.compile("|".join(_ADDRESS_FORMS))


def without_addresses(text: str) -> str:
    """`text` with every network address, socket URL and IP replaced by `<address>`."""
    return _ADDRESS_PATTERNS.sub(ADDRESS, text)


def without_query(target: str) -> str:
    """A request target or URL without its query string and fragment."""
    return target.split("?", 1)[0].split("#", 1)[0]


class RedactingAccessLogger(AbstractAccessLogger):
    """aiohttp's access line (client, request line, status, size, time, referer, agent) with every query string cut:
    `?token=KEY` never reaches the log, whichever route it was sent to."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        version = f"HTTP/{request.version.major}.{request.version.minor}"
        referer = without_query(request.headers.get("Referer", "-"))
        self.logger.info(
            '%s "%s %s %s" %d %d %.6f "%s" "%s"',
            request.remote or "-",
            request.method,
            request.path,
            version,
            response.status,
            response.body_length,
            time,
            referer,
            request.headers.get("User-Agent", "-"),
        )

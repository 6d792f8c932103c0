"""Which HTTP paths need `--api-key`: every one but the liveness probes.

`/health` and `/ping` (SageMaker's probe) stay open so load balancers and orchestrators can probe without the key;
everything else, the OpenAI API and the side doors alike (`/tokenize`, `/detokenize`, `/version`, `/metrics`,
`/dashboard*`, `/debug/*`), needs `Authorization: Bearer KEY`. The dashboard's routes also take its cookie or `?token=`
(a browser's EventSource cannot send headers: frontend/dashboard.py). `--disable-metrics-auth` leaves `/metrics` open
for Prometheus scrapers that carry no key. CORS preflights (OPTIONS with Access-Control-Request-Method) carry no
credentials by design and are answered by the CORS middleware, which runs first. Every comparison is constant-time.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web

from tokenmill.config import ServerConfig
from tokenmill.frontend.dashboard import check_access
from tokenmill.frontend.errors import APIError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]

# /ready too: a readiness probe (Kubernetes, a load balancer) sends no key, and it says only the phase
OPEN_PATHS = frozenset({"/health", "/ping", "/ready"})
METRICS_PATH = "/metrics"
DASHBOARD_PATH_PREFIXES = ("/dashboard", "/debug/")


def bearer_token(request: web.Request) -> bytes:
    given = request.headers.get("Authorization", "")
    return given[len("Bearer ") :].encode() if given.startswith("Bearer ") else b""


def needs_key(path: str, server: ServerConfig) -> bool:
    """Whether `path` is behind the key (when one is set)."""
    if path in OPEN_PATHS:
        return False
    return not (path == METRICS_PATH and server.disable_metrics_auth)


def make_auth_middleware(server: ServerConfig) -> Middleware:
    """The middleware that refuses, with a 401, a request to a keyed path without the key."""
    expected = server.api_key.encode() if server.api_key else None

    @web.middleware
    async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if expected is None or request.method == "OPTIONS" or not needs_key(request.path, server):
            return await handler(request)
        if request.path.startswith(DASHBOARD_PATH_PREFIXES):
            check_access(request, server.api_key)  # bearer, the dashboard cookie or ?token=
        elif not hmac.compare_digest(bearer_token(request), expected):
            raise APIError(401, "Invalid or missing API key (send `Authorization: Bearer <key>`).")
        return await handler(request)

    return auth_middleware

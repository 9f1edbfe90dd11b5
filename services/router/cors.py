"""CORS for browsers calling the gateway from another origin (vLLM's --allowed-origins,
--allowed-methods, --allowed-headers, --allow-credentials, with Starlette's CORSMiddleware rules
that vLLM serves with): a preflight (OPTIONS with Origin and Access-Control-Request-Method) is
answered here, before the API key is asked for (browsers send none on a preflight): 200 when the
origin, method and headers are allowed, else 400 "Disallowed CORS ..."; every other response to
a request with an Origin carries Access-Control-Allow-Origin when the origin is allowed, streamed
answers included. No origins (the default, as vLLM's): no cross-origin access."""
from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
SAFELISTED_HEADERS = {"accept", "accept-language", "content-language", "content-type"}
MAX_AGE_S = 600
PREFLIGHT_VARY = "Origin, Access-Control-Request-Method, Access-Control-Request-Headers"


@dataclass(frozen=True)
class CorsPolicy:
    origins: tuple[str, ...] = ()  # "*": any
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False

    def __post_init__(self) -> None:
        for name in ("origins", "methods", "headers"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"--allowed-{name} must be a JSON array of strings")
            object.__setattr__(self, name, tuple(value))

    @property
    def any_origin(self) -> bool:
        return "*" in self.origins

    @property
    def allowed_methods(self) -> tuple[str, ...]:
        return ALL_METHODS if "*" in self.methods else tuple(m.upper() for m in self.methods)

    def allows(self, origin: str) -> bool:
        return self.any_origin or origin in self.origins

    def preflight(self, request: web.Request) -> web.Response:
        origin = request.headers["Origin"]
        method = request.headers["Access-Control-Request-Method"]
        asked = request.headers.get("Access-Control-Request-Headers")
        headers = {"Vary": PREFLIGHT_VARY, "Access-Control-Allow-Methods": ", ".join(self.allowed_methods),
                   "Access-Control-Max-Age": str(MAX_AGE_S)}
        failures = []
        if self.allows(origin):
            headers["Access-Control-Allow-Origin"] = origin if not self.any_origin or self.credentials else "*"
        else:
            failures.append("origin")
        if method.upper() not in self.allowed_methods:
            failures.append("method")
        if "*" in self.headers:
            if asked is not None:
                headers["Access-Control-Allow-Headers"] = asked  # any: mirrored
        else:
            allowed = SAFELISTED_HEADERS | {h.lower() for h in self.headers}
            headers["Access-Control-Allow-Headers"] = ", ".join(sorted(allowed))
            if asked is not None and any(h.strip().lower() not in allowed for h in asked.split(",") if h.strip()):
                failures.append("headers")
        if self.credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
        if failures:
            return web.Response(status=400, text="Disallowed CORS " + ", ".join(failures), headers=headers)
        return web.Response(status=200, text="OK", headers=headers)

    def decorate(self, request: web.Request, response: web.StreamResponse) -> None:
        """An answer to a request from another origin: allowed (the origin, or "*" for any
        origin without credentials), and Vary: Origin either way."""
        origin = request.headers.get("Origin")
        if origin is None:
            return
        if self.allows(origin):
            response.headers["Access-Control-Allow-Origin"] = (
                "*" if self.any_origin and not self.credentials else origin)
            if self.credentials:
                response.headers["Access-Control-Allow-Credentials"] = "true"
        vary = response.headers.get("Vary")
        response.headers["Vary"] = f"{vary}, Origin" if vary else "Origin"


def is_preflight(request: web.Request) -> bool:
    return (request.method == "OPTIONS" and "Origin" in request.headers
            and "Access-Control-Request-Method" in request.headers)

"""The app's ASGI middleware and the limits it enforces (`FrontEndLimits`): the API key every route
but OPEN_ROUTES needs, and the request id every response carries."""

import secrets
import uuid
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from spmoe.entrypoints.serve.frontend.protocol import ApiError

OPEN_ROUTES = ("/health", "/ping", "/metrics")  # the routes that need no API key
DEFAULT_MAX_REQUEST_BYTES = 32 * 2**20


@dataclass(frozen=True)
class FrontEndLimits:
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # a longer body gets 413
    api_key: str | None = None  # None: no key needed

    def __post_init__(self):
        if self.max_request_bytes < 1:
            raise ValueError(f"--max-request-bytes must be >= 1, got {self.max_request_bytes}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key (or SPMOE_API_KEY) must not be empty")


class RequireApiKey:
    """ASGI middleware: every HTTP route but OPEN_ROUTES answers 401 unless the request carries
    `Authorization: Bearer <api_key>` (compared in constant time)."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_ROUTES:
            given = next(
                (value for name, value in scope["headers"] if name == b"authorization"), b""
            )
            if not secrets.compare_digest(given, self.expected):
                error = ApiError(
                    401,
                    "a valid API key is required: send the header 'Authorization: Bearer <key>'",
                )
                response = JSONResponse(
                    error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"}
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestIdMiddleware:
    """Every HTTP request gets an id: the client's `X-Request-Id`, or a new one. It is
    `request.state.request_id` for the handlers (and their log lines) and goes back as the
    response's `X-Request-Id` header. Plain ASGI (no response wrapping), so that a handler still
    sees its client go away."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        sent = dict(scope["headers"]).get(b"x-request-id")
        request_id = sent.decode("latin-1") if sent else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [
                    *message.get("headers", []),
                    (b"x-request-id", request_id.encode("latin-1")),
                ]
            await send(message)

        await self.app(scope, receive, send_with_id)

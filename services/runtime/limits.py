"""Request limits shared by the services: a body-size cap (413) and one answer for bodies that
fail validation (422, or 400 where a service says so for malformed JSON).

The validation answer is `{"message": "<one line>", "detail": [{"loc", "msg", "type"}, …]}`:
at most `MAX_ERRORS` errors, every string cut to `MAX_TEXT_CHARS`, never pydantic's `input`
or `ctx` (they echo the request back: 41 MB out for 41 MB in). Strings are made encodable
first (a JSON `"\\ud800"` escape is a lone surrogate, which UTF-8 cannot encode), so rendering
the answer cannot fail. `InflightLimit` sheds load (503 at once) past a number of requests in
progress. Not a defence against slow clients: that belongs in front.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

MAX_ERRORS = 20  # a batch of 10k bad items answers 20 errors, not 10k
MAX_SUMMARY_ERRORS = 5  # errors named in the one-line `message`
MAX_TEXT_CHARS = 200  # a msg or loc part may quote the client (a dict key, a ValueError text)


def install_validation_handler(
    app: FastAPI,
    on_reject: Callable[[Request, bool], None],
    *,
    malformed_status: int = 422,
    sglang_error: bool = False,
) -> None:
    """Answer `RequestValidationError` with the bounded body above; `on_reject(request,
    malformed_json)` counts it. `sglang_error` adds SGLang's `{"error": {"message", "code"}}`."""

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        raw = exc.errors()
        malformed = any(e.get("type") == "json_invalid" for e in raw)
        on_reject(request, malformed)
        status = malformed_status if malformed else 422
        errors = [
            {
                "loc": [p if isinstance(p, int) else _text(p) for p in e.get("loc", ())],
                "msg": _text(e.get("msg", "")),
                "type": _text(e.get("type", "")),
            }
            for e in raw[:MAX_ERRORS]
        ]
        body: dict = {"message": _summary(errors, len(raw)), "detail": errors}
        if sglang_error:
            body["error"] = {"message": body["message"], "code": status}
        return JSONResponse(body, status_code=status)


def _text(value: object) -> str:
    return str(value)[:MAX_TEXT_CHARS].encode("utf-8", "backslashreplace").decode("utf-8")


def _summary(errors: list[dict], total: int) -> str:
    parts = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in errors[:MAX_SUMMARY_ERRORS]]
    more = f" (and {total - len(parts)} more)" if total > len(parts) else ""
    return "; ".join(parts) + more if parts else "invalid request body"


class BodyLimit:
    """ASGI middleware: 413 for a body over `max_bytes`, from its Content-Length before a byte is
    read, or as soon as a streamed (chunked) body passes the limit; `on_refused()` counts it."""

    def __init__(self, app, max_bytes: int, on_refused: Callable[[], None]):
        self.app = app
        self.max_bytes = max_bytes
        self.on_refused = on_refused

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = f"request body larger than {self.max_bytes} bytes"
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            self.on_refused()
            return await JSONResponse({"detail": too_large}, status_code=413)(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                self.on_refused()
                raise HTTPException(status_code=413, detail=too_large)  # FastAPI re-raises it as is
            return message

        await self.app(scope, limited, send)


class InflightLimit:
    """ASGI middleware: at most `max_inflight` guarded requests (`methods` on paths under
    `prefixes`) in progress; one more answers 503 with `Retry-After` before its body is read,
    and `on_refused()` counts it. Load shedding: past what the service can parse and enqueue,
    a queue of waiting requests would make every answer (and the health probe, on the same
    event loop) as slow as the whole backlog."""

    def __init__(
        self,
        app,
        max_inflight: int,
        on_refused: Callable[[], None],
        prefixes: tuple[str, ...] = ("/",),
        methods: frozenset[str] = frozenset({"POST"}),
    ):
        self.app = app
        self.max_inflight = max_inflight
        self.on_refused = on_refused
        self.prefixes, self.methods = prefixes, methods
        self.inflight = 0

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] != "http"
            or scope["method"] not in self.methods
            or not scope["path"].startswith(self.prefixes)
        ):
            return await self.app(scope, receive, send)
        if self.inflight >= self.max_inflight:
            self.on_refused()
            busy = JSONResponse(
                {"detail": f"overloaded: {self.inflight} requests in progress, retry shortly"},
                status_code=503,
                headers={"Retry-After": "1"},
            )
            return await busy(scope, receive, send)
        self.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.inflight -= 1

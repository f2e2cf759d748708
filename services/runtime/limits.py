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

import asyncio
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


DRAIN_MAX_BYTES = 1 << 30  # of a refused body read and dropped so that the client sees the 413
DRAIN_TIMEOUT_S = 30.0


class BodyLimit:
    """ASGI middleware: 413 for a body over `max_bytes`, from its Content-Length before a byte is
    read, or as soon as a streamed (chunked) body passes the limit; `on_refused()` counts it.

    The 413 goes out at once, and then the rest of the body is read and dropped (at most
    `DRAIN_MAX_BYTES`, for `DRAIN_TIMEOUT_S`) before the connection closes: a client still
    sending a large body (most HTTP clients write the whole body before they read) would
    otherwise hit a connection reset and never see the answer. A client that sent
    `Expect: 100-continue` is never asked for its body, so nothing is drained."""

    def __init__(self, app, max_bytes: int, on_refused: Callable[[], None]):
        self.app = app
        self.max_bytes = max_bytes
        self.on_refused = on_refused

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = f"request body larger than {self.max_bytes} bytes"
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"")
        drain = headers.get(b"expect", b"").lower() != b"100-continue"
        refused = False
        body_done = False

        async def answer(message):  # the refusal's last body chunk waits for the drain
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            elif message["type"] == "http.response.body" and not message.get("more_body") and drain:
                await send({**message, "more_body": True})
                if not body_done:
                    await _drain(receive)
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        if declared.isdigit() and int(declared) > self.max_bytes:
            self.on_refused()
            return await JSONResponse({"detail": too_large}, status_code=413)(scope, receive, answer)
        seen = 0

        async def limited():
            nonlocal seen, refused, body_done
            message = await receive()
            seen += len(message.get("body", b""))
            body_done = not message.get("more_body", False)
            if seen > self.max_bytes and not refused:
                refused = True
                self.on_refused()
                raise HTTPException(status_code=413, detail=too_large)  # FastAPI re-raises it as is
            return message

        async def forward(message):
            await (answer if refused else send)(message)

        await self.app(scope, limited, forward)


async def _drain(receive) -> None:
    """Read and drop the rest of a request body, within the bounds above."""
    dropped = 0
    deadline = asyncio.get_running_loop().time() + DRAIN_TIMEOUT_S
    while dropped < DRAIN_MAX_BYTES:
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            return
        try:
            message = await asyncio.wait_for(receive(), left)
        except TimeoutError:
            return
        if message["type"] != "http.request":
            return  # the client went away
        dropped += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


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

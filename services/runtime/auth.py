"""Bearer-token auth (docs/architecture.md §9).

Two tokens, one scheme (`Authorization: Bearer <token>`):

* `ASYNCRL_API_TOKEN`: when set, every endpoint of every service except the probes
  (`/healthz`, `/health`, `/metrics`) requires it, except the rollout's engine fleet
  (`/v1/engines`), which requires the engine token whenever the rollout holds one: joining an
  engine makes the rollout send the engine token to the URL it is given.
* The engine token: `ASYNCRL_ENGINE_API_TOKEN`, else `ASYNCRL_API_TOKEN`. The reference
  engine requires it on its control endpoints (weight updates, update groups, pause/continue,
  abort, flush: every endpoint that changes state); an engine started without one listens on
  loopback only and refuses them altogether (403). Its data endpoints (generation, read-only
  info) take either token, and need one only when `ASYNCRL_API_TOKEN` is set or the engine
  listens beyond loopback (`services/engine/app.py`). `asyncrl up` and `asyncrl demo` generate
  an engine token per run when none is set and hand it to every process they start; engine
  clients (the rollout's engine client, the trainer's broadcast publisher) send it on every
  call (`engine_token()`).

The Tinker-compatible service (`asyncrl tinker`) also takes the token as `X-API-Key: <token>`, the
header the `tinker` SDK sends (`install_auth(..., api_key_header=True)`).

The scheme name is matched case-insensitively (RFC 7235 §2.1); tokens are compared in constant
time (both sides hashed first, so not even the length leaks). A token shorter than
MIN_TOKEN_CHARS, with fewer than MIN_DISTINCT_CHARS distinct characters, or with characters a
header cannot carry is refused when a service starts (`check_token`): a floor against
placeholders like `changeme`, not a proof of strength.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Callable, Collection

API_TOKEN_ENV = "ASYNCRL_API_TOKEN"
ENGINE_TOKEN_ENV = "ASYNCRL_ENGINE_API_TOKEN"
OPEN_PATHS = frozenset({"/healthz", "/health", "/metrics"})
MIN_TOKEN_CHARS = 16  # 16 random url-safe characters are 96 bits; placeholders are shorter
MIN_DISTINCT_CHARS = 8  # refuses `aaaa…` and a placeholder repeated (`changemechangeme`: 7)
TOKEN_HINT = "e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))'"


class WeakToken(ValueError):
    """A configured token that `check_token` refuses."""


def check_token(token: str, name: str = API_TOKEN_ENV) -> None:
    """Raise `WeakToken` (naming `name`, never echoing the token) unless `token` passes the floor."""
    if len(token) < MIN_TOKEN_CHARS:
        problem = f"shorter than {MIN_TOKEN_CHARS} characters"
    elif len(set(token)) < MIN_DISTINCT_CHARS:
        problem = f"fewer than {MIN_DISTINCT_CHARS} distinct characters"
    elif not all("!" <= c <= "~" for c in token):  # what a header value carries as a bearer token
        problem = "characters other than printable ASCII without spaces"
    else:
        return
    raise WeakToken(f"{name} is too weak ({problem}); set a random token, {TOKEN_HINT}")


def generate_token() -> str:
    """A fresh random token (256 bits, url-safe)."""
    return secrets.token_urlsafe(32)


def engine_token() -> str | None:
    """The token engine clients send: `ASYNCRL_ENGINE_API_TOKEN`, else `ASYNCRL_API_TOKEN`."""
    return os.environ.get(ENGINE_TOKEN_ENV) or os.environ.get(API_TOKEN_ENV) or None


def bearer_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def engine_auth_headers() -> dict[str, str]:
    return bearer_headers(engine_token())


def bearer_matches(header: str, token: str) -> bool:
    """`header` is `Bearer <token>` (any case of the scheme name), compared in constant time."""
    scheme, _, credentials = header.strip().partition(" ")
    given = hashlib.sha256(credentials.strip().encode()).digest()
    expected = hashlib.sha256(token.encode()).digest()
    return hmac.compare_digest(given, expected) and scheme.lower() == "bearer"


def install_auth(
    app, token: str | None = None, *, engine_control: Collection[str] = (), api_key_header: bool = False
) -> None:
    """Require the bearer token (`token`, else `ASYNCRL_API_TOKEN`; a weak one raises `WeakToken`)
    on every path but OPEN_PATHS; without any token, nothing is required.

    Paths under the prefixes `engine_control` (a service's routes that make it call a URL its
    caller names with the engine token: the rollout's engine fleet) take the engine token
    (`engine_token()`) instead, whenever the service holds one: the API token alone, or no
    token, must not be a way to have the engine token sent to a host of the caller's choosing.
    `api_key_header`: a request without an Authorization header may carry the token as
    `X-API-Key` instead (the `tinker` SDK's header)."""
    token = token if token is not None else os.environ.get(API_TOKEN_ENV) or None
    control = engine_token() if engine_control else None
    if token:
        check_token(token)
    if control and control != token:
        check_token(control, ENGINE_TOKEN_ENV)
    if not token and not control:
        return
    prefixes = tuple(p.rstrip("/") for p in engine_control)

    def refusal(path: str, header: str) -> int | None:
        if path in OPEN_PATHS:
            return None
        if control and any(path == p or path.startswith(p + "/") for p in prefixes):
            return None if bearer_matches(header, control) else 401
        if token:
            return None if bearer_matches(header, token) else 401
        return None

    _install(app, refusal, api_key_header=api_key_header)


def install_engine_auth(
    app,
    *,
    control_token: str | None,
    data_tokens: Collection[str],
    data_paths: Collection[str],
    control_open: bool = False,
) -> None:
    """The engine's two tiers. OPEN_PATHS: open. `data_paths` (generation, read-only info): any
    of `data_tokens`, or open when there are none. Every other path (the control plane, and any
    path added later): `control_token` only; 403 when there is none (unless `control_open`,
    for in-process test engines). Weak tokens raise `WeakToken`."""
    for token in (control_token, *data_tokens):
        if token is not None:
            check_token(token)
    data_paths = frozenset(data_paths)

    def refusal(path: str, header: str) -> int | None:
        if path in OPEN_PATHS:
            return None
        if path in data_paths:
            return 401 if data_tokens and not any(bearer_matches(header, t) for t in data_tokens) else None
        if control_token is None:
            return None if control_open else 403
        return None if bearer_matches(header, control_token) else 401

    _install(app, refusal)


def _install(app, refusal: Callable[[str, str], int | None], *, api_key_header: bool = False) -> None:
    app.add_middleware(_BearerAuth, refusal=refusal, api_key_header=api_key_header)


class _BearerAuth:
    """ASGI middleware answering `refusal(path, Authorization header)` (401, 403) or passing the
    request on (None). Plain ASGI, not `BaseHTTPMiddleware`: the body stream reaches the app
    untouched, so `BodyLimit`'s 413 on a streamed body still comes out as a 413."""

    def __init__(self, app, refusal: Callable[[str, str], int | None], api_key_header: bool = False):
        self.app, self.refusal, self.api_key_header = app, refusal, api_key_header

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), "")
        if not header and self.api_key_header:
            key = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"x-api-key"), "")
            header = f"Bearer {key}" if key else ""
        status = self.refusal(scope["path"], header)
        if status is None:
            return await self.app(scope, receive, send)
        from fastapi.responses import JSONResponse

        if status == 403:
            detail = (
                f"{scope['path']} is disabled: this engine was started without an API token "
                f"({ENGINE_TOKEN_ENV} or {API_TOKEN_ENV})"
            )
            response = JSONResponse({"detail": detail}, status_code=403)
        else:
            response = JSONResponse(
                {"detail": "missing or invalid bearer token"},
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        await response(scope, receive, send)

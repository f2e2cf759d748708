"""Client of OpenEnv env servers (`proto/openenv.py`): the configured servers only
(`[rollout.openenv.NAME]`), one session per episode.

A `ws(s)://` server keeps the episode's environment in the server for the life of one
WebSocket; an `http(s)://` one is called statelessly. At most `max_sessions` episodes hold a
session of one server at once (OpenEnv refuses a connection past its `max_concurrent_envs`).

Failures, each counted (`asyncrl_rollout_openenv_errors_total{server, kind}`):
* `ActionRefused`: the server refused the action (`VALIDATION_ERROR`, HTTP 422); the socket
  stays usable, the episode goes on with the error as the observation;
* `EnvironmentFailed("dropped")`: no connection, a socket closed mid-episode, a timeout, an
  HTTP 5xx; the episode cannot continue (its state is gone with the socket) and starts again
  from reset;
* `EnvironmentFailed("server_error", retry=False)`: the server answered an error (any other
  code) or garbage; a restart would meet it again, so the episode fails with its message.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import httpx
from pydantic import ValidationError

from asyncrl.proto.openenv import VALIDATION_ERROR, OpenEnvMessage, OpenEnvResult, OpenEnvSchema
from asyncrl.services.rollout import metrics as m
from asyncrl.services.rollout.clients.environments import EnvironmentFailed
from asyncrl.services.rollout.config import OpenEnvServer

if TYPE_CHECKING:
    from websockets.asyncio.client import ClientConnection

MAX_MESSAGE_BYTES = 4 << 20  # one server message; observations are cut far shorter for the policy
SCHEMA_TTL_S = 30.0
MESSAGE_CHARS = 300  # of a server's error message, in our errors


class ActionRefused(Exception):
    """The server refused the action (its action model did not validate it)."""


class OpenEnvClient:
    def __init__(self, servers: dict[str, OpenEnvServer]):
        self.servers = servers
        self._slots = {name: asyncio.Semaphore(s.max_sessions) for name, s in servers.items()}
        self._schemas: dict[str, tuple[float, OpenEnvSchema]] = {}
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=10.0))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def schema(self, name: str) -> OpenEnvSchema:
        """The server's `/schema`, cached for SCHEMA_TTL_S; `EnvironmentFailed("unavailable")`."""
        now = time.monotonic()
        cached = self._schemas.get(name)
        if cached and now - cached[0] < SCHEMA_TTL_S:
            return cached[1]
        server = self.servers[name]
        try:
            resp = await self._http.get(f"{server.http_url}/schema", timeout=server.timeout_s)
            resp.raise_for_status()
            schema = OpenEnvSchema.model_validate_json(resp.content)
        except (httpx.HTTPError, ValidationError) as exc:
            m.OPENENV_ERRORS.labels(name, "unavailable").inc()
            raise EnvironmentFailed(
                "unavailable", f"cannot read the OpenEnv schema of {name!r}: {str(exc)[:MESSAGE_CHARS]}"
            ) from None
        self._schemas[name] = (now, schema)
        return schema

    @asynccontextmanager
    async def session(self, name: str):
        """One episode's session with server `name` (`WebSocketSession` or `HttpSession`)."""
        server = self.servers[name]
        async with self._slots[name]:
            if not server.websocket:
                yield HttpSession(name, server, self._http)
                return
            # (here, not at the top: a rollout service with no ws:// server never loads websockets)
            from websockets.asyncio.client import connect
            from websockets.exceptions import InvalidHandshake, InvalidURI

            try:
                ws = await connect(
                    server.url + "/ws", open_timeout=server.timeout_s, max_size=MAX_MESSAGE_BYTES
                )
            except (OSError, TimeoutError, InvalidHandshake, InvalidURI) as exc:
                m.OPENENV_ERRORS.labels(name, "dropped").inc()
                raise EnvironmentFailed("dropped", f"cannot connect to OpenEnv {name!r}: {exc}") from None
            try:
                yield WebSocketSession(name, server, ws)
            finally:
                await _close(ws)


async def _close(ws: ClientConnection) -> None:
    """Say goodbye (the server then frees the environment) and close; a dead socket is fine."""
    from websockets.exceptions import WebSocketException

    try:
        await ws.send(json.dumps({"type": "close"}))
        await ws.close()
    except (WebSocketException, OSError):
        pass


class WebSocketSession:
    """An episode over one WebSocket: reset, then steps, the environment kept by the server."""

    def __init__(self, name: str, server: OpenEnvServer, ws: ClientConnection):
        self.name, self.server, self.ws = name, server, ws

    async def reset(self, data: dict) -> OpenEnvResult:
        return await self._ask({"type": "reset", "data": data})

    async def step(self, action: dict) -> OpenEnvResult:
        return await self._ask({"type": "step", "data": action})

    async def _ask(self, message: dict) -> OpenEnvResult:
        from websockets.exceptions import WebSocketException

        try:
            await self.ws.send(json.dumps(message))
            raw = await asyncio.wait_for(self.ws.recv(), timeout=self.server.timeout_s)
        except (WebSocketException, OSError, TimeoutError) as exc:
            m.OPENENV_ERRORS.labels(self.name, "dropped").inc()
            raise EnvironmentFailed(
                "dropped", f"OpenEnv {self.name!r} {message['type']}: {type(exc).__name__}: {exc}"
            ) from None
        try:
            answer = OpenEnvMessage.model_validate_json(raw)
            if answer.type == "observation":
                return OpenEnvResult.model_validate(answer.data)
        except ValidationError as exc:
            m.OPENENV_ERRORS.labels(self.name, "garbage").inc()
            raise EnvironmentFailed(
                "server_error", f"OpenEnv {self.name!r} answered garbage: {exc.errors()[:2]}", retry=False
            ) from None
        code = str(answer.data.get("code", answer.type))
        text = f"{code}: {str(answer.data.get('message', ''))[:MESSAGE_CHARS]}"
        if code == VALIDATION_ERROR and message["type"] == "step":
            m.OPENENV_ERRORS.labels(self.name, "refused_action").inc()
            raise ActionRefused(f"{text} {json.dumps(answer.data.get('errors', []))[:MESSAGE_CHARS]}")
        m.OPENENV_ERRORS.labels(self.name, "server_error").inc()
        raise EnvironmentFailed(
            "server_error", f"OpenEnv {self.name!r} {message['type']}: {text}", retry=False
        )


class HttpSession:
    """An episode over `POST /reset` and `/step`: every call meets a fresh environment, so only a
    stateless environment (or one step per episode) makes sense here."""

    def __init__(self, name: str, server: OpenEnvServer, http: httpx.AsyncClient):
        self.name, self.server, self.http = name, server, http

    async def reset(self, data: dict) -> OpenEnvResult:
        return await self._post("reset", data)

    async def step(self, action: dict) -> OpenEnvResult:
        return await self._post("step", {"action": action})

    async def _post(self, verb: str, body: dict) -> OpenEnvResult:
        try:
            resp = await self.http.post(f"{self.server.url}/{verb}", json=body, timeout=self.server.timeout_s)
        except httpx.HTTPError as exc:
            m.OPENENV_ERRORS.labels(self.name, "dropped").inc()
            raise EnvironmentFailed(
                "dropped", f"OpenEnv {self.name!r} /{verb}: {type(exc).__name__}"
            ) from None
        if resp.status_code == 422 and verb == "step":
            m.OPENENV_ERRORS.labels(self.name, "refused_action").inc()
            raise ActionRefused(f"{VALIDATION_ERROR}: {resp.text[:MESSAGE_CHARS]}")
        if resp.status_code >= 500:
            m.OPENENV_ERRORS.labels(self.name, "dropped").inc()
            raise EnvironmentFailed("dropped", f"OpenEnv {self.name!r} /{verb}: HTTP {resp.status_code}")
        try:
            resp.raise_for_status()
            return OpenEnvResult.model_validate_json(resp.content)
        except (httpx.HTTPError, ValidationError) as exc:
            m.OPENENV_ERRORS.labels(self.name, "server_error").inc()
            raise EnvironmentFailed(
                "server_error", f"OpenEnv {self.name!r} /{verb}: {str(exc)[:MESSAGE_CHARS]}", retry=False
            ) from None

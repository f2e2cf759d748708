"""Client of sglang-router's worker API (sglang-router >= 0.3, the SGLang Model Gateway), for the
engine fleet (`services/rollout/fleet.py`).

The router of 0.3 has no `/add_worker` or `/remove_worker` any more (404): `POST /workers
{"url"}` and `DELETE /workers/{id}` queue the change and answer 202 at once, and `GET /workers`
lists `{"id", "url", "is_healthy", …}` once it is done (a URL the router cannot reach is never
listed). Adding a URL already listed answers with its id and changes nothing. So `add` and
`remove` wait, up to a deadline, until the list says the change is done; both are idempotent.
"""

from __future__ import annotations

import asyncio
import time

import httpx

from asyncrl.services.rollout import metrics as m

LIST_POLL_S = 0.05  # between two reads of the worker list while a change is queued


class RouterError(Exception):
    """The router refused a change, did not answer, or did not finish it in time."""


class RouterClient:
    def __init__(self, url: str, *, timeout_s: float, headers: dict[str, str] | None = None):
        self.url = url
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), headers=headers)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def workers(self) -> dict[str, dict]:
        """The router's workers by URL (each `{"id", "url", "is_healthy", …}`)."""
        resp = await self._call("GET", "/workers")
        try:
            return {w["url"].rstrip("/"): w for w in resp.json()["workers"]}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise self._failed("list", f"not a worker list: {resp.text[:200]}") from exc

    async def add(self, url: str, deadline_s: float) -> None:
        """Add `url` and wait until the router lists it healthy."""
        await self._call("POST", "/workers", json={"url": url})
        await self._until(
            lambda workers: url in workers and workers[url].get("is_healthy"), deadline_s, "add", url
        )
        m.ROUTER_CALLS.labels("add", "ok").inc()

    async def remove(self, url: str, deadline_s: float) -> None:
        """Take `url` out of the router (nothing to do when it is not listed) and wait until the
        worker deleted is not listed any more. By its id: the router gives a URL added again a
        new id, so an add by another replica meanwhile (services/rollout/fleet.py) is not this
        removal still pending, and is that replica's to undo."""
        listed = (await self.workers()).get(url)
        if listed is not None:
            gone = listed["id"]
            resp = await self._call("DELETE", f"/workers/{gone}", ok=(202, 404))
            if resp.status_code == 202:
                await self._until(
                    lambda workers: workers.get(url, {}).get("id") != gone, deadline_s, "remove", url
                )
        m.ROUTER_CALLS.labels("remove", "ok").inc()

    async def _until(self, done, deadline_s: float, op: str, url: str) -> None:
        deadline = time.monotonic() + deadline_s
        while not done(await self.workers()):
            if time.monotonic() > deadline:
                past = {"add": "added", "remove": "removed"}[op]
                raise self._failed(op, f"{url} not {past} by the router within {deadline_s:g} s")
            await asyncio.sleep(LIST_POLL_S)

    async def _call(self, method: str, path: str, *, json=None, ok=(200, 202)) -> httpx.Response:
        op = {"GET": "list", "POST": "add", "DELETE": "remove"}[method]
        try:
            resp = await self._http.request(method, f"{self.url}{path}", json=json)
        except httpx.HTTPError as exc:
            raise self._failed(op, f"router {self.url}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code not in ok:
            raise self._failed(
                op, f"router {self.url} answered {method} {path} with {resp.status_code}: {resp.text[:200]}"
            )
        return resp

    def _failed(self, op: str, message: str) -> RouterError:
        m.ROUTER_CALLS.labels(op, "error").inc()
        return RouterError(message)

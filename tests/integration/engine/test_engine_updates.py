"""The rollout's weight-update calls against an engine on loopback that records what it is
sent (a stand-in for SGLang: it answers with SGLang's shapes, and can be told to fail)."""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import REGISTRY
from rollout_server import free_port

from asyncrl.services.rollout.engine_client import EngineClient
from asyncrl.services.runtime.serving import serve_app_in_thread


def recording_engine(calls: list, *, update_ok: bool = True, continue_status: int = 200,
                     update_delay_s: float = 0.0) -> FastAPI:  # fmt: skip
    app = FastAPI()

    @app.post("/update_weights_from_disk")
    async def update(req: Request) -> JSONResponse:
        calls.append(("update", await req.json(), time.monotonic()))
        await asyncio.sleep(update_delay_s)  # time is the subject: an update that takes this long
        message = "Succeeded." if update_ok else "cannot read /nowhere: no such file"
        return JSONResponse({"success": update_ok, "message": message, "num_paused_requests": 0},
                            status_code=200 if update_ok else 400)  # fmt: skip

    @app.post("/continue_generation")
    async def resume(req: Request) -> JSONResponse:
        calls.append(("continue", await req.json(), time.monotonic()))
        if continue_status != 200:
            return JSONResponse({"error": {"message": "scheduler gone"}}, status_code=continue_status)
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.post("/{op}")
    async def other(op: str) -> JSONResponse:
        calls.append((op, None, time.monotonic()))
        return JSONResponse({})

    return app


def update(url: str, path: str, version: int, timeout_s: float = 10, abort: bool = True) -> list[str]:
    async def go() -> list[str]:
        client = EngineClient([url], [url], timeout_s=10, retries=0, backoff_s=0.1, unhealthy_after=3,
                              probe_s=1.0, update_timeout_s=timeout_s, update_abort=abort)  # fmt: skip
        try:
            errors = await client.update_all_from_disk(path, version)
            await asyncio.wait_for(
                asyncio.gather(*client._continues), 30
            )  # the continue goes out in the background
            return errors
        finally:
            await client.aclose()

    return asyncio.run(go())


def continue_errors() -> float:
    return (
        REGISTRY.get_sample_value(
            "asyncrl_rollout_engine_requests_total", {"engine": "0", "op": "continue", "result": "error"}
        )
        or 0.0
    )


def test_an_update_is_one_aborting_load_then_a_continue():
    calls: list = []
    server = serve_app_in_thread(recording_engine(calls), free_port(), "fake-engine")
    try:
        assert update(server.url, "/ckpt/v7", 7) == []
    finally:
        server.stop()
    assert [op for op, _, _ in calls] == ["update", "continue"]  # no separate pause or flush
    assert calls[0][1] == {"model_path": "/ckpt/v7", "weight_version": "7", "flush_cache": True,
                           "abort_all_requests": True}  # fmt: skip
    assert calls[0][2] <= calls[1][2]


def test_an_update_without_abort_lets_the_requests_in_flight_finish_first():
    """`weight_update_abort = false` (the demo's): the same single call, asking the engine to let
    its running requests finish under the old weights (SGLang's default) instead of aborting them."""
    calls: list = []
    server = serve_app_in_thread(recording_engine(calls), free_port(), "fake-engine")
    try:
        assert update(server.url, "/ckpt/v7", 7, abort=False) == []
    finally:
        server.stop()
    assert [op for op, _, _ in calls] == ["update", "continue"]
    assert calls[0][1]["abort_all_requests"] is False


def test_a_failed_continue_is_counted_and_the_update_still_stands():
    calls: list = []
    before = continue_errors()
    server = serve_app_in_thread(recording_engine(calls, continue_status=503), free_port(), "fake-engine")
    try:
        assert update(server.url, "/ckpt/v8", 8) == []
    finally:
        server.stop()
    assert [op for op, _, _ in calls] == ["update", "continue"]
    assert continue_errors() == before + 1


def test_a_refused_update_is_reported_with_the_engine_message():
    calls: list = []
    server = serve_app_in_thread(recording_engine(calls, update_ok=False), free_port(), "fake-engine")
    try:
        errors = update(server.url, "/nowhere", 9)
    finally:
        server.stop()
    assert errors == [f"{server.url}: cannot read /nowhere: no such file"]


def test_an_update_that_times_out_still_sends_the_continue():
    """The engine may have aborted and paused before the answer was lost: continue anyway."""
    calls: list = []
    server = serve_app_in_thread(recording_engine(calls, update_delay_s=3.0), free_port(), "fake-engine")
    try:
        errors = update(server.url, "/ckpt/v10", 10, timeout_s=0.5)
    finally:
        server.stop()
    assert len(errors) == 1 and errors[0].startswith(f"{server.url}: ReadTimeout")
    assert [op for op, _, _ in calls] == ["update", "continue"]

"""In-flight weight updates (`[rollout] weight_update_in_flight`, PipelineRL's): a request that
spans an update is not aborted; the reference engine reports SGLang 0.5.23's per-token
`meta_info.weight_versions` spans, each token keeps the version that sampled it, and the
buffer's staleness bound holds per token. Plus the route fallback for servers before 0.5.23
and the `seed` alias against a stub that refuses unknown `sampling_params` keys as 0.5.23's
schema does (its accepted names from tests/data/sglang_0_5_23_contract.json)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from engine_server import serve_in_thread
from factories import make_sample
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from msgspec.structs import replace
from prometheus_client import REGISTRY
from rollout_server import free_port
from waiting import wait_until

from asyncrl.buffer import Buffer, Groups
from asyncrl.proto import Group
from asyncrl.services.ops.tinymodel import build_tiny_model
from asyncrl.services.rollout.clients.engine import EngineClient
from asyncrl.services.rollout.segments import Draft, _extend
from asyncrl.services.rollout.service import _server_info
from asyncrl.services.runtime.serving import serve_app_in_thread

torch.set_num_threads(1)

CONTRACT = json.loads((Path(__file__).parents[2] / "data" / "sglang_0_5_23_contract.json").read_text())

PROMPT = [1, 12, 13, 14, 15, 16]
TOTAL = 150
PARAMS = {"max_new_tokens": TOTAL, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    base = tmp_path_factory.mktemp("weights")
    for seed in (0, 1):
        build_tiny_model(str(base / f"w{seed}"), seed=seed)
    return {seed: str(base / f"w{seed}") for seed in (0, 1)}


def client(url: str, *, in_flight: bool) -> EngineClient:
    return EngineClient([url], [url], timeout_s=60, retries=0, backoff_s=0.1, unhealthy_after=3, probe_s=1.0,
                        update_timeout_s=60, update_abort=True, update_in_flight=in_flight)  # fmt: skip


def generated(url: str) -> int:
    return httpx.get(f"{url}/server_info").json()["internal_states"][0]["generated_tokens"]


async def generate_across_an_update(url: str, new_weights: str) -> tuple:
    """One greedy request of TOTAL tokens; an in-flight update to version 2 once 5 are out."""
    engines = client(url, in_flight=True)
    try:
        base = generated(url)
        engine = engines.engines[0]
        task = asyncio.ensure_future(engines.generate(engine, [PROMPT], [dict(PARAMS)], set()))

        async def five_out() -> None:
            while generated(url) < base + 5:
                assert not task.done(), "the request finished before the update"
                await asyncio.sleep(0.002)

        await asyncio.wait_for(five_out(), 30)
        errors = await engines.update_all_from_disk(new_weights, 2)
        (gen,) = await asyncio.wait_for(task, 60)
        await asyncio.wait_for(asyncio.gather(*engines._continues), 30)
        return errors, gen
    finally:
        await engines.aclose()


def test_a_request_spanning_an_in_flight_update_keeps_each_tokens_version(weights, redis_url, run_id):
    eng = serve_in_thread(weights[0], max_new_tokens_cap=200, weight_version="1")
    try:
        errors, gen = asyncio.run(generate_across_an_update(eng.url, weights[1]))
        assert errors == []
        assert gen.finish_reason == "length" and len(gen.output_ids) == TOTAL  # not aborted, not resubmitted
        k = gen.token_versions.count("1")
        assert 5 <= k < TOTAL and gen.token_versions == ["1"] * k + ["2"] * (TOTAL - k)
        assert gen.weight_version == "2"
        # the tokens after the update are what the new weights give for prompt + tokens so far
        rest = httpx.post(
            f"{eng.url}/generate",
            json={
                "input_ids": PROMPT + gen.output_ids[:k],
                "sampling_params": {**PARAMS, "max_new_tokens": TOTAL - k},
            },
            timeout=60,
        ).json()
        assert rest["output_ids"] == gen.output_ids[k:]
        assert rest["meta_info"]["weight_versions"] == [{"version": "2", "start": 0, "end": TOTAL - k}]
    finally:
        eng.stop()

    # the draft and the buffer see each token's own version: min_version is the old one
    d = Draft(index=0)
    assert (
        _extend(d, gen, budget=TOTAL, prompt_len=len(PROMPT), context_length=1024, initial_version=0) is False
    )
    assert d.versions == [1] * k + [2] * (TOTAL - k) and d.lineage == {0: 2} and d.segments == 1
    sample = replace(
        make_sample("g", 0, n_tokens=TOTAL),
        completion_ids=np.asarray(d.tokens, dtype=np.int32),
        behavior_logprobs=np.asarray(d.logprobs, dtype=np.float32),
        versions=np.asarray(d.versions, dtype=np.int32),
    )
    group = Group.build(group_id="g", job_id="j", prompt_tokens=np.asarray(PROMPT, dtype=np.int32),
                        reward_spec={"verifier": "reverse"}, samples=[sample], submit_version=1)  # fmt: skip
    assert group.min_version == 1
    conn = Buffer(redis_url, run_id)
    try:
        groups = Groups(conn, "trainer-0")
        assert groups.put([group]) == [True]
        # at trainer version 2 with η = 0 the old-version tokens make the group too stale
        assert groups.take(1, current_version=2, max_staleness=0, block_ms=200).dropped == ["g"]
        assert groups.put([replace(group, group_id="g2")]) == [True]
        taken = groups.take(1, current_version=2, max_staleness=1, block_ms=200)
        assert [g.group_id for g in taken.groups] == ["g2"] and taken.staleness == [1]
    finally:
        conn.close()


def old_routes_only(bodies: list | None = None) -> FastAPI:
    """A server before 0.5.23's route names (only `/get_model_info`, `/get_server_info`) that
    refuses unknown `sampling_params` keys as 0.5.23's schema does, and records `/generate`."""
    app = FastAPI()
    accepted = set(CONTRACT["sampling_params"])

    @app.get("/get_model_info")
    async def get_model_info() -> dict:
        return {"model_path": "m", "tokenizer_path": "m", "weight_version": "7"}

    @app.get("/get_server_info")
    async def get_server_info() -> dict:
        return {"version": "0.5.4"}

    @app.post("/generate")
    async def generate(req: Request) -> JSONResponse:
        body = await req.json()
        (bodies if bodies is not None else []).append(body)
        unknown = set(body["sampling_params"]) - accepted
        if unknown:
            return JSONResponse({"error": f"unknown field `{min(unknown)}`"}, status_code=400)
        meta = {"id": "r_0", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 1,
                "completion_tokens": 1, "weight_version": "7", "output_token_logprobs": [[-0.5, 9, None]]}  # fmt: skip
        return JSONResponse([{"text": "x", "output_ids": [9], "meta_info": meta}])

    return app


def test_an_alias_reaches_the_engine_as_sglangs_field_and_server_info_falls_back():
    bodies: list = []
    server = serve_app_in_thread(old_routes_only(bodies), free_port(), "old-sglang")

    async def go() -> tuple:
        engines = EngineClient([server.url], [server.url], timeout_s=10, retries=0, backoff_s=0.1,
                               unhealthy_after=3, probe_s=1.0, update_timeout_s=10)  # fmt: skip
        try:
            gens = await engines.generate(
                engines.engines[0], [[1, 2]], [{"seed": 5, "max_new_tokens": 1}], set()
            )
        finally:
            await engines.aclose()
        async with httpx.AsyncClient() as http:
            info = await _server_info(http, 0, server.url)
        return gens, info

    try:
        (gen,), info = asyncio.run(go())
    finally:
        server.stop()
    assert gen.output_ids == [9]
    assert bodies[0]["sampling_params"] == {"sampling_seed": 5, "max_new_tokens": 1}
    assert info == {"version": "0.5.4"}


def fallbacks() -> float:
    labels = {"route": "/model_info"}
    return REGISTRY.get_sample_value("asyncrl_rollout_engine_route_fallbacks_total", labels) or 0.0


def test_an_engine_without_the_new_routes_is_read_through_the_old_ones(weights):
    old = serve_app_in_thread(old_routes_only(), free_port(), "old-sglang")
    new = serve_in_thread(weights[0], weight_version="3")
    before = fallbacks()

    async def read(urls: list[str]) -> list[list[str | None]]:
        engines = EngineClient(urls, urls, timeout_s=10, retries=0, backoff_s=0.1, unhealthy_after=3,
                               probe_s=1.0, update_timeout_s=10)  # fmt: skip
        try:
            return [await engines.weight_versions(), await engines.weight_versions()]
        finally:
            await engines.aclose()

    try:
        assert asyncio.run(read([old.url, new.url])) == [["7", "3"], ["7", "3"]]
    finally:
        old.stop()
        new.stop()
    assert fallbacks() == before + 1  # one 404, then the old name is remembered for that engine


def test_the_in_flight_update_is_pause_retract_update_without_abort_continue(weights):
    eng = serve_in_thread(weights[0], weight_version="1")
    calls: list[str] = []

    async def go() -> list[str]:
        engines = client(eng.url, in_flight=True)

        async def record(req: httpx.Request) -> None:
            calls.append(f"{req.url.path} {req.content.decode()}")

        engines._control_http.event_hooks["request"].append(record)
        try:
            errors = await engines.update_all_from_disk(weights[1], 5)
            await asyncio.wait_for(asyncio.gather(*engines._continues), 30)
            return errors
        finally:
            await engines.aclose()

    try:
        assert asyncio.run(go()) == []
        wait_until(
            lambda: httpx.get(f"{eng.url}/model_info").json()["weight_version"] == "5",
            message="the engine serves version 5",
        )
        assert httpx.get(f"{eng.url}/server_info").json()["internal_states"][0]["paused"] is None
    finally:
        eng.stop()
    assert [c.split(" ")[0] for c in calls] == [
        "/pause_generation",
        "/update_weights_from_disk",
        "/continue_generation",
    ]
    assert '"mode":"retract"' in calls[0].replace(" ", "")
    assert '"abort_all_requests":false' in calls[1].replace(" ", "")
    assert '"torch_empty_cache":true' in calls[2].replace(" ", "")

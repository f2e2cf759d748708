"""services/tinker/sampling.py against a real reference engine: which engine answers are the
client's error (the request is wrong) and which are the service's (the engine or its setup)."""

from __future__ import annotations

import asyncio

import pytest
from engine_server import serve_in_thread

from asyncrl.proto import tinker as wire
from asyncrl.services.tinker.sampling import EngineError, Sampler, SampleRefused

ENGINE_TOKEN = "engine-t0ken-for-the-sampling-test-0123"


@pytest.fixture(scope="module")
def guarded_engine(tiny):
    """An engine whose every endpoint wants a token (ASYNCRL_API_TOKEN when it starts)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("ASYNCRL_API_TOKEN", ENGINE_TOKEN)
        running = serve_in_thread(str(tiny), seed=0)
    yield running
    running.stop()


def request(tokens: list[int] = [5, 6, 7]) -> wire.SampleRequest:  # noqa: B006 (read only)
    return wire.SampleRequest(
        prompt=wire.ModelInput(chunks=[wire.Chunk(tokens=tokens)]),
        sampling_params=wire.SamplingParams(max_tokens=2),
        sampling_session_id="s:sample:0",
    )


def sample(url: str, body: wire.SampleRequest) -> dict:
    async def go() -> dict:
        sampler = Sampler([url], timeout_s=30, max_loaded=2, max_tokens=8)
        try:
            return await sampler.sample(body, {"adapter_name": None})
        finally:
            await sampler.aclose()

    return asyncio.run(go())


def test_an_engine_refusing_the_service_is_a_server_error(guarded_engine, monkeypatch):
    # 401: the service holds no engine token (or a wrong one). Nothing the client can change.
    monkeypatch.delenv("ASYNCRL_API_TOKEN", raising=False)
    monkeypatch.delenv("ASYNCRL_ENGINE_API_TOKEN", raising=False)
    with pytest.raises(EngineError, match="answered 401"):
        sample(guarded_engine.url, request())


def test_a_request_the_engine_finds_wrong_is_the_clients_error(guarded_engine, monkeypatch):
    monkeypatch.setenv("ASYNCRL_ENGINE_API_TOKEN", ENGINE_TOKEN)  # read when the sampler is made
    with pytest.raises(SampleRefused, match=r"input_ids out of the vocabulary \[0, 54\)"):
        sample(guarded_engine.url, request([10**6]))
    assert len(sample(guarded_engine.url, request())["sequences"]) == 1

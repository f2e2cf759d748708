"""The `/generate` bodies the rollout's engine client sends, judged by SGLang 0.5.23's own
contract check: the generated `sglang/api/v1/api_types.py` of the real wheel, which its
`/generate` runs on every body (`api_contract.generate_contract_error`) and which refuses
unknown keys inside `sampling_params` with a 400.

The wheel goes into a venv of its own with `--no-deps` (its dependencies are torch, CUDA
kernels and more, none of which the schema needs); only `api_types.py` is loaded, by path, with
msgspec beside it, so `sglang/__init__` (which imports torch) never runs.
"""

from __future__ import annotations

import asyncio
import json
import subprocess

import httpx
import pytest
from thirdparty import thirdparty_venv

from asyncrl.proto.sglang import SamplingParams
from asyncrl.services.rollout.clients.engine import EngineClient

# `make test-extended` (.ci/run's second stage): builds a venv of the SGLang wheel
pytestmark = pytest.mark.extended

CHECK = """
import importlib.util, json, os, sys
root = importlib.util.find_spec("sglang").submodule_search_locations[0]
spec = importlib.util.spec_from_file_location("api_types", os.path.join(root, "api", "v1", "api_types.py"))
api = importlib.util.module_from_spec(spec)
sys.modules["api_types"] = api
spec.loader.exec_module(api)
out = []
for body in json.load(sys.stdin):
    try:
        api.GenerateRequest.from_json_value(body)
        out.append(None)
    except api.JsonContractError as exc:
        out.append(str(exc))
print(json.dumps(out))
"""

# Everything a validated rollout request can carry (aliases included), at non-default values.
REQUESTS = [
    {"seed": 7, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "max_new_tokens": 8},
    {"sampling_seed": 3, "stop": ["\n"], "stop_token_ids": [2], "min_new_tokens": 1, "ignore_eos": True},
    {"frequency_penalty": 0.5, "presence_penalty": 0.5, "repetition_penalty": 1.1, "no_stop_trim": True},
    {"skip_special_tokens": False, "spaces_between_special_tokens": False, "n": 1, "logit_bias": {"5": 1.0}},
    {"regex": "[a-z]+", "max_new_tokens": 4},
]


def sent_bodies() -> list[dict]:
    """What `EngineClient.generate` puts on the wire for each of REQUESTS (a mock transport
    records the bodies and answers like SGLang)."""
    bodies: list[dict] = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        meta = {"id": "r_0", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 2,
                "completion_tokens": 1, "output_token_logprobs": [[-0.5, 9, None]]}  # fmt: skip
        return httpx.Response(200, json=[{"text": "x", "output_ids": [9], "meta_info": meta}])

    async def go() -> None:
        engines = EngineClient(["http://sglang"], ["http://sglang"], timeout_s=10, retries=0, backoff_s=0.1,
                               unhealthy_after=3, probe_s=1.0, update_timeout_s=10)  # fmt: skip
        await engines._http.aclose()
        engines._http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        try:
            for raw in REQUESTS:
                params = SamplingParams.model_validate(raw).model_dump(exclude_unset=True, exclude_none=True)
                # an evaluation's dict config goes to the client unvalidated: alias and all
                for p in (params, raw):
                    await engines.generate(engines.engines[0], [[1, 2]], [p], set())
        finally:
            await engines.aclose()

    asyncio.run(go())
    return bodies


def test_every_body_we_send_passes_sglang_0_5_23s_schema():
    python = thirdparty_venv("sglang-schema", ["--no-deps", "sglang==0.5.23", "msgspec==0.23.0"])
    bodies = sent_bodies()
    assert len(bodies) == 2 * len(REQUESTS)
    assert bodies[1]["sampling_params"]["sampling_seed"] == 7 and "seed" not in bodies[1]["sampling_params"]

    def judge(batch: list[dict]) -> list[str | None]:
        run = subprocess.run([str(python), "-c", CHECK], input=json.dumps(batch), capture_output=True, text=True,
                             timeout=120, check=True)  # fmt: skip
        return json.loads(run.stdout)

    assert judge(bodies) == [None] * len(bodies)
    # and the check is real: the raw alias is what 0.5.23 refuses
    (refusal,) = judge([{**bodies[1], "sampling_params": {"seed": 7}}])
    assert refusal is not None and "unknown field `seed`" in refusal

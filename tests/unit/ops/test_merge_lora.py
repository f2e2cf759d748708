"""`asyncrl model merge-lora`: an adapter as the trainer publishes it (trainer/lora.py's names
and config, rsLoRA folded, written by the disk publisher) merged into its base loads as a plain
HF model, with the logits of peft's merged model and of the adapter-wrapped model it came from."""

from __future__ import annotations

import pytest
import torch

from asyncrl.services.ops.gguf import main as model_cli

torch.set_num_threads(1)
PROBE = torch.tensor([[1, 5, 6, 7, 9, 12, 30, 31]])


@pytest.fixture(scope="module")
def published(tiny, tmp_path_factory):
    """A version's adapter directory, its B matrices drawn at random (a trained adapter's: the
    initial B = 0 would merge to the base itself), and the wrapped model's logits."""
    from transformers import AutoModelForCausalLM

    from asyncrl.trainer.config import LoraSettings
    from asyncrl.trainer.lora import adapter_config, adapter_state_dict, wrap
    from asyncrl.trainer.publish import DiskPublisher

    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    model = wrap(base, LoraSettings(rank=4, alpha=8.0, rslora=True), list(base.model.layers))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
        logits = model(input_ids=PROBE).logits
    out = DiskPublisher(tmp_path_factory.mktemp("w"), tiny, adapter_config=adapter_config(model, tiny))
    return out.write(5, adapter_state_dict(model)).path, logits


def test_merged_checkpoint_is_a_plain_model_with_the_adapters_logits(tiny, published, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter, wrapped_logits = published
    assert model_cli(["merge-lora", adapter, "--out", str(tmp_path / "merged")]) == 0
    assert "merged into its base" in capsys.readouterr().out
    files = {p.name for p in (tmp_path / "merged").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    assert not {"adapter_config.json", "adapter_model.safetensors"} & files
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert type(merged).__name__ == "Qwen2ForCausalLM"
    assert not any("lora" in k or "base_layer" in k for k in merged.state_dict())
    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    with torch.no_grad():
        plain = base(input_ids=PROBE).logits
        peft_merged = PeftModel.from_pretrained(base, adapter).merge_and_unload()(input_ids=PROBE).logits
        got = merged(input_ids=PROBE).logits
    assert torch.allclose(got, peft_merged, atol=1e-5, rtol=0)
    assert torch.allclose(got, wrapped_logits, atol=1e-4, rtol=0)  # merged, it is the model that trained
    assert float((got - plain).abs().max()) > 1e-2  # and not the base


def test_merge_lora_refuses_what_it_cannot_merge(tiny, published, tmp_path, capsys):
    adapter, _ = published
    assert model_cli(["merge-lora", str(tiny), "--out", str(tmp_path / "a")]) == 2
    assert "is not a PEFT adapter directory" in capsys.readouterr().err
    assert model_cli(["merge-lora", adapter, "--out", str(tmp_path / "b"), "--base", str(tmp_path)]) == 2
    assert "no base model at" in capsys.readouterr().err
    (tmp_path / "c").mkdir()
    assert model_cli(["merge-lora", adapter, "--out", str(tmp_path / "c")]) == 2
    assert "exists" in capsys.readouterr().err

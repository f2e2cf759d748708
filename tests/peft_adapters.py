"""Real PEFT LoRA adapters for the engine's tests: `LoraConfig` + `get_peft_model` +
`save_pretrained` on a model directory, with lora_B drawn at random (PEFT starts it at zero,
which would make every adapter a no-op), and the teacher-forced log-probs of the PEFT-wrapped
model the engine's must equal."""

from __future__ import annotations

from pathlib import Path

import torch

B_STD = 0.3  # large enough that an adapter moves the log-probs by tenths, small enough to stay sane


def save_peft_adapter(model_dir: str | Path, out: str | Path, *, targets, seed: int, r: int = 4,
                      lora_alpha: float = 8, **config) -> Path:  # fmt: skip
    """A PEFT adapter of `model_dir` targeting `targets` (a list of module names, or
    "all-linear"), saved to `out`; `config`: more `LoraConfig` fields (use_rslora, use_dora, …)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    peft_model = get_peft_model(
        model, LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=targets, **config)
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * B_STD)
    peft_model.save_pretrained(str(out))
    return Path(out)


def teacher_forced_logprobs(model_dir: str | Path, adapter_dir: str | Path | None, prompt: list[int],
                            output: list[int]) -> torch.Tensor:  # fmt: skip
    """log p(output[i] | prompt + output[:i]) under the model, PEFT-wrapped with `adapter_dir`
    (None: the base model): [len(output)]."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0]
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), dim=-1)
    return logp.gather(1, torch.tensor(output)[:, None]).squeeze(1)


def prompt_logprobs(model_dir: str | Path, adapter_dir: str | Path | None, prompt: list[int]) -> torch.Tensor:
    """log p(prompt[j] | prompt[:j]) for j ≥ 1 under the (PEFT-wrapped) model: [len(prompt) - 1]."""
    return teacher_forced_logprobs(model_dir, adapter_dir, prompt[:1], prompt[1:])

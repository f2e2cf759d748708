"""Peak memory and tokens/s of one trainer step on a Qwen3-shaped model with the real 151,936-token
vocabulary, for today's path and each memory feature of #17, every figure against today's path
measured in the same run.

Model: Qwen3 architecture (tied embeddings, GQA, q/k norms) with vocab 151,936 and hidden size,
depth and heads reduced to fit CPU time (printed with the results). Batch: 16 samples of at most
1,024 tokens, prompt lengths uniform in [32, 256], completion lengths log-normal (median 300
tokens, σ 0.7) cut to fit: the spread of real answers.

Variants (each in a fresh process, two steps: time is the faster, memory the second's; the
trainer's own FSDP2 model on a world of one, AdamW):
  today      padded micro-batches (4 samples), full logits through the model's forward for every
             position from the first completion token on, log-softmax of all of them (the path
             before #17, kept here as the baseline)
  chunked    padded, log-probs and entropy from the hidden states 1,024 tokens at a time
  chunked_mb8  the same with the trainer's default micro_batch_size, 8 (more padding)
  packed     + packed micro-batches of at most 4,096 tokens (no padding; per-sample SDPA
             segments on CPU, trainer/attention.py)
  checkpoint + activation checkpointing per decoder layer

Figures: peak RSS of the step above the RSS before it (`VmHWM` reset through
/proc/self/clear_refs; on CUDA `max_memory_allocated`); the logits part alone (log-probs +
entropy forward and backward of one 4,096-token micro-batch from its hidden states: full vs
chunked); tokens/s (prompt + completion tokens of the batch / step seconds); and the largest
difference of the loss and of every gradient from today's path.

    .venv/bin/python benchmarks/trainer_memory.py            # ~10 min on 2 CPU cores
    .venv/bin/python benchmarks/trainer_memory.py --quick    # a smaller vocabulary, smoke test
Prints one JSON object; figures go to benchmarks/RESULTS.md by hand.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np
import torch

VOCAB = 151_936
SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 28,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}  # Qwen3-1.7B's depth and proportions, hidden 2048 → 256
VARIANTS = {
    "today": {"layout": "padded", "micro": 4, "chunk": 0, "ac": False, "legacy": True},
    "chunked": {"layout": "padded", "micro": 4, "chunk": 1024, "ac": False, "legacy": False},
    "chunked_mb8": {"layout": "padded", "micro": 8, "chunk": 1024, "ac": False, "legacy": False},
    "packed": {"layout": "packed", "micro": 4, "chunk": 1024, "ac": False, "legacy": False},
    "checkpoint": {"layout": "packed", "micro": 4, "chunk": 1024, "ac": True, "legacy": False},
}
PACK_TOKENS = 4096


def build_model_dir(path: Path, vocab: int) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=vocab, tie_word_embeddings=True, max_position_embeddings=2048,
                      pad_token_id=0, **SHAPE)  # fmt: skip
    Qwen3ForCausalLM(cfg).save_pretrained(path)


def make_groups(vocab: int, seed: int = 0, samples: int = 16, max_len: int = 1024):
    """4 groups of 4: each group one prompt, completions of log-normal lengths."""
    from asyncrl.proto import Group, Sample

    rng = np.random.default_rng(seed)
    groups = []
    for g in range(samples // 4):
        p = int(rng.integers(32, 257))
        prompt = rng.integers(3, vocab, p).astype(np.int32)
        out = []
        for i in range(4):
            n = int(np.clip(rng.lognormal(np.log(300), 0.7), 8, max_len - p))
            out.append(Sample(prompt_id=f"p{g}", index=i, completion_ids=rng.integers(3, vocab, n).astype(np.int32),
                              behavior_logprobs=rng.uniform(-12, -10, n).astype(np.float32),
                              versions=np.zeros(n, np.int32), finish_reason="length",
                              reward=float(rng.integers(0, 2)), reward_status="scored"))  # fmt: skip
        groups.append(Group.build(group_id=f"g{g}", job_id="bench", prompt_tokens=prompt, reward_spec={"verifier": "x"},
                                  samples=out, submit_version=0))  # fmt: skip
    return groups


def legacy_token_logprobs(model, batch, temperature=1.0, with_entropy=False, chunk_tokens=0):
    """The path before #17: the model's forward builds logits for every position from the
    earliest completion token on (`logits_to_keep`), gathered and log-softmaxed whole."""
    n, width = batch.input_ids.shape
    rows = torch.arange(n)[:, None]
    pos = batch.token_index - rows * width  # column of the position predicting token t
    first = int(pos[batch.present].min())
    logits = model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, logits_to_keep=width - first
    ).logits
    vocab = logits.shape[-1]
    sel = (
        logits.gather(1, (pos - first).clamp(min=0).unsqueeze(-1).expand(-1, -1, vocab)).float() / temperature
    )
    logp = torch.log_softmax(sel, dim=-1)
    lp = logp.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1) * batch.present
    entropy = -(logp.exp() * logp).sum(-1) * batch.present if with_entropy else None
    return lp, entropy


class Peak:
    """Peak memory above the level when `reset` was called: RSS on CPU, allocator on CUDA."""

    def __init__(self, device: torch.device):
        self.device = device

    @staticmethod
    def _status(key: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            import ctypes

            ctypes.CDLL("libc.so.6").malloc_trim(
                0
            )  # hand freed heap back first: the baseline is what is live
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            self.base = self._status("VmRSS")

    def bytes(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return self._status("VmHWM") - self.base


def variant_worker(name: str, model_dir: str, vocab: int, out_dir: str, device: str) -> None:
    torch.set_num_threads(1)
    import asyncrl.trainer.step as step_mod
    from asyncrl.trainer.batch import build_rows, micro_batches
    from asyncrl.trainer.losses import LossConfig
    from asyncrl.trainer.model import build_model, init_distributed
    from asyncrl.trainer.step import StepConfig, policy_step

    v = VARIANTS[name]
    d = init_distributed(device, timeout_s=3600)
    if v["legacy"]:
        step_mod.token_logprobs = legacy_token_logprobs
    model = build_model(model_dir, d, activation_checkpointing=v["ac"], packing=v["layout"] == "packed")
    rows = build_rows(make_groups(vocab), "grpo").rows
    tokens = sum(len(r.prompt_tokens) + len(r.completion_ids) for r in rows)
    micro = micro_batches(
        rows, 0, 1, 1, v["micro"], 0, d.device, PACK_TOKENS if v["layout"] == "packed" else 0
    )
    cfg = StepConfig(loss=LossConfig(), grad_clip=1e9, entropy_coef=0.001, chunk_tokens=v["chunk"])
    grads: dict[str, torch.Tensor] = {}

    class SnapshotAdamW(torch.optim.AdamW):
        """AdamW that keeps the first step's gradients (what the variants must agree on)."""

        def step(self, closure=None):
            if not grads:
                for pname, p in model.named_parameters():
                    g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                    grads[pname] = g.detach().float().cpu().clone()
            return super().step(closure)

    opt = SnapshotAdamW(model.parameters(), lr=1e-5)
    peak = Peak(d.device)
    t0 = time.perf_counter()
    first = policy_step(model, opt, micro, [None] * len(micro), [None] * len(micro), cfg, d.device)
    seconds = time.perf_counter() - t0
    torch.save(grads, Path(out_dir) / f"{name}.grads.pt")
    grads.clear()
    peak.reset()
    t0 = time.perf_counter()
    policy_step(model, opt, micro, [None] * len(micro), [None] * len(micro), cfg, d.device)
    seconds = min(
        seconds, time.perf_counter() - t0
    )  # the faster of the two steps: less noise from other load
    padded = sum(mb.input_ids.numel() for mb in micro)
    result = {"step_peak_bytes": peak.bytes(), "step_s": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
              "computed_positions": padded, "micro_batches": len(micro), "loss": first["loss"],
              "grad_norm": first["grad_norm"], "attention": model.config._attn_implementation}  # fmt: skip
    (Path(out_dir) / f"{name}.json").write_text(json.dumps(result))


def logits_part(vocab: int, hidden: int, tokens: int, chunk: int) -> dict:
    """Peak extra memory of log-probs + entropy forward and backward of `tokens` hidden states."""
    from asyncrl.trainer.logprobs import head_logprobs

    torch.manual_seed(0)
    h = torch.randn(tokens, hidden, requires_grad=True)
    w = (torch.randn(vocab, hidden) / hidden**0.5).requires_grad_(True)
    y = torch.randint(0, vocab, (tokens,))
    out = {}
    for name, c in (("full", 0), ("chunked", chunk)):
        h.grad = w.grad = None
        peak = Peak(torch.device("cpu"))
        peak.reset()
        lp, ent = head_logprobs(h, w, None, y, 1.0, c, True)
        (lp.sum() + 0.01 * ent.sum()).backward()
        out[name] = peak.bytes()
        del lp, ent
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="vocabulary 32,000 (a smoke test)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    vocab = 32_000 if args.quick else VOCAB
    torch.set_num_threads(1)
    out: dict = {"model": {"architecture": "Qwen3", "vocab_size": vocab, **SHAPE, "tie_word_embeddings": True},
                 "batch": {"samples": 16, "max_len": 1024, "max_tokens_per_micro_batch": PACK_TOKENS},
                 "device": args.device}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        build_model_dir(model_dir, vocab)
        rows_lengths = [[len(g.prompt_tokens), int(n)] for g in make_groups(vocab) for n in g.samples.lengths]
        out["batch"]["lengths"] = rows_lengths
        out["logits_part_4096_tokens"] = logits_part(vocab, SHAPE["hidden_size"], 4096, 1024)
        ctx = mp.get_context("spawn")
        names = args.variants.split(",")
        for name in names:
            os.environ.update(OMP_NUM_THREADS="1")
            p = ctx.Process(target=variant_worker, args=(name, str(model_dir), vocab, tmp, args.device))
            p.start()
            p.join()
            if p.exitcode != 0:
                raise SystemExit(f"variant {name} failed ({p.exitcode})")
            out[name] = json.loads((Path(tmp) / f"{name}.json").read_text())
            print(name, out[name], file=sys.stderr, flush=True)
        base_grads = torch.load(Path(tmp) / f"{names[0]}.grads.pt", weights_only=True)
        for name in names[1:]:
            grads = torch.load(Path(tmp) / f"{name}.grads.pt", weights_only=True)
            out[name]["max_grad_diff_vs_" + names[0]] = max(
                float((grads[k] - base_grads[k]).abs().max()) for k in grads
            )
            out[name]["loss_diff_vs_" + names[0]] = abs(out[name]["loss"] - out[names[0]]["loss"])
            out[name]["step_peak_ratio_vs_" + names[0]] = out[names[0]]["step_peak_bytes"] / max(
                out[name]["step_peak_bytes"], 1
            )
            out[name]["tokens_per_s_ratio_vs_" + names[0]] = (
                out[name]["tokens_per_s"] / out[names[0]]["tokens_per_s"]
            )
        for padded in ("chunked", "chunked_mb8"):
            if "packed" in out and padded in out:
                out["packed"][f"tokens_per_s_ratio_vs_{padded}"] = (
                    out["packed"]["tokens_per_s"] / out[padded]["tokens_per_s"]
                )
    part = out["logits_part_4096_tokens"]
    part["ratio"] = part["full"] / max(part["chunked"], 1)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

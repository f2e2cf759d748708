"""LoRA checkpoints (trainer/checkpoint.py with `[trainer.lora]`) on real gloo ranks: a checkpoint
holds the adapters and their AdamW state and nothing of the frozen base, and a run resumed from it,
on the same or a different number of ranks, continues exactly as the uninterrupted run does.

The plan of tests/integration/trainer/test_checkpoint_sharded.py, with a LoRA model:
  2 ranks: `ref2` trains K steps, checkpoints at v=K into ck2, trains M more
  1 rank:  `2to1` resumes ck2 and trains M; `ref1` trains K, checkpoints into ck1, trains M more;
           a LoRA trainer refuses a full fine-tune's checkpoint, one of rank 2 refuses ck1
  2 ranks: `2to2` resumes ck2 and trains M; `1to2` resumes ck1 and trains M
Every rank trains on the same batch and nothing is clipped, so runs on 1 and 2 ranks are
bit-identical and every comparison below is exact.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from spawned import finish_worker, gloo_rank, run_ranks

torch.set_num_threads(1)
K, M = 3, 3  # steps before the checkpoint, steps after it
LR, RANK = 1e-2, 4
ADAPTER_TENSORS = 2 * 7 * 2  # A and B of 7 Linear layers in each of 2 decoder layers
# r·(in + out) per Linear of the tiny Qwen2 (test_lora.py spells it out): 2048·r per layer, 2 layers
ADAPTER_PARAMS = RANK * 2048 * 2
# the tiny Qwen2's own weights: 54×128 tied embedding, per layer q/k/v/o with q/k/v biases
# (128·128 + 128 + 2·(128·64 + 64) + 128·128) + MLP 3·128·256 + 2 norms of 128; the final norm
BASE_PARAMS = 54 * 128 + 2 * (2 * 128 * 128 + 128 + 2 * (128 * 64 + 64) + 3 * 128 * 256 + 2 * 128) + 128


def train_step(model, opt, sched, v: int) -> None:
    g = torch.Generator().manual_seed(v)  # batch v is the same on every rank and in every run
    ids = torch.randint(3, 40, (2, 8), generator=g)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()


def build(d, model_dir, lora: bool = True, rank: int = RANK):
    from asyncrl.trainer.config import LoraSettings
    from asyncrl.trainer.model import build_model
    from asyncrl.trainer.schedule import build_scheduler

    model = build_model(model_dir, d, lora=LoraSettings(rank=rank if lora else 0, alpha=8.0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.1)
    return model, opt, build_scheduler(opt, "cosine", 2, 6, 0.1)


def run_job(d, model_dir, name: str, resume: Path | None = None, save: Path | None = None) -> dict | None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from asyncrl.trainer.checkpoint import Checkpointer
    from asyncrl.trainer.lora import adapter_state_dict

    torch.manual_seed(100 + d.rank)  # a different RNG stream per rank: the checkpoint must keep each
    model, opt, sched = build(d, model_dir)
    if resume is not None:
        version = Checkpointer(resume, d).load(model, opt, sched).version
    else:
        for v in range(K):
            train_step(model, opt, sched, v)
        Checkpointer(save, d).save(model, opt, sched, K, [f"g{v}" for v in range(K)])
        version = K
    # cloned: on one rank the gathered adapters are the parameters themselves
    at_checkpoint = {k: v.clone() for k, v in adapter_state_dict(model).items()}
    draws = [torch.empty(3) for _ in range(d.world)]
    dist.all_gather(draws, torch.rand(3))  # where each rank's RNG stands right after save / load
    lrs = []
    for v in range(version, K + M):
        lrs.append(opt.param_groups[0]["lr"])
        train_step(model, opt, sched, v)
    adapters = adapter_state_dict(model)
    optim = get_optimizer_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if not d.is_main:
        return None
    return {"name": name, "version": version, "lrs": lrs, "draws": draws, "at_checkpoint": at_checkpoint,
            "adapters": adapters, "optim": optim["state"], "last_epoch": sched.last_epoch}  # fmt: skip


def refuse_other_checkpoints(d, model_dir, out: Path) -> None:
    """A full fine-tune's checkpoint, then a LoRA trainer starting on it; a LoRA checkpoint of
    rank 4, then a trainer of rank 2 (same names, other shapes): both refused, named."""
    from asyncrl.trainer.checkpoint import Checkpointer

    model, opt, sched = build(d, model_dir, lora=False)
    train_step(model, opt, sched, 0)
    Checkpointer(out / "ck_full", d).save(model, opt, sched, 1, [])
    for checkpoint, rank, refused in (("ck_full", RANK, "refused_full.txt"), ("ck1", 2, "refused_rank.txt")):
        model, opt, sched = build(d, model_dir, rank=rank)
        try:
            Checkpointer(out / checkpoint, d).load(model, opt, sched)
        except ValueError as exc:
            (out / refused).write_text(str(exc))


def worker(rank: int, world: int, port: int, model_dir: Path, jobs: list[dict], out: Path) -> None:
    with gloo_rank(rank, world, port) as d:
        for job in jobs:
            if job.get("refuse"):
                refuse_other_checkpoints(d, model_dir, out)
                continue
            result = run_job(d, model_dir, **job)
            if d.is_main:
                torch.save(result, out / f"{job['name']}.pt")
    finish_worker()  # (only after a clean run: an exception above exits non-zero)


def launch(world: int, model_dir: Path, jobs: list[dict], out: Path) -> None:
    run_ranks(world, worker, model_dir, jobs, out, timeout_s=240)


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_ckpt")
    ck1, ck2 = out / "ck1", out / "ck2"
    launch(2, tiny, [{"name": "ref2", "save": ck2}], out)
    launch(1, tiny, [{"name": "2to1", "resume": ck2}, {"name": "ref1", "save": ck1}, {"refuse": True}], out)
    launch(2, tiny, [{"name": "2to2", "resume": ck2}, {"name": "1to2", "resume": ck1}], out)
    names = ("ref2", "2to1", "ref1", "2to2", "1to2")
    return {n: torch.load(out / f"{n}.pt", weights_only=True) for n in names}, out


def test_a_checkpoint_holds_the_adapters_and_their_optimizer_state_only(runs):
    from asyncrl.trainer.checkpoint import CheckedReader

    out = runs[1]
    for ck, world in (("ck2", 2), ("ck1", 1)):
        step = out / ck / f"step_{K:08d}"
        tensors = CheckedReader(step).read_metadata().state_dict_metadata
        model_keys = [k for k in tensors if k.startswith("model.")]
        assert len(model_keys) == ADAPTER_TENSORS
        assert all(".lora_A." in k or ".lora_B." in k for k in model_keys), model_keys
        optim_keys = [k for k in tensors if k.startswith("optim.")]
        assert len(optim_keys) == 3 * ADAPTER_TENSORS  # step, exp_avg, exp_avg_sq of each adapter
        assert all(".lora_A." in k or ".lora_B." in k for k in optim_keys)
        assert {p.name for p in step.glob("*.distcp")} == {f"__{r}_0.distcp" for r in range(world)}
        # what it stores: the adapters, their two moments (fp32) and a step count per adapter
        stored = sum(math.prod(m.size) * m.properties.dtype.itemsize for m in tensors.values())
        assert stored == 3 * ADAPTER_PARAMS * 4 + ADAPTER_TENSORS * 4
    # the files (DCP adds ~1 KB per tensor) are well under the frozen base they leave out (~1.2 MB)
    files = sum(p.stat().st_size for p in (out / "ck2" / f"step_{K:08d}").glob("*.distcp"))
    assert files < 0.5 * BASE_PARAMS * 4


def test_another_trainers_checkpoint_is_refused_by_name(runs):
    full = (runs[1] / "refused_full.txt").read_text()  # 27 base tensors, 28 adapters: all differ
    assert "holds 27 model tensors, this trainer trains 28, 55 of them differing" in full
    assert "[trainer.lora]" in full
    other_rank = (runs[1] / "refused_rank.txt").read_text()  # the same names, r = 2 instead of 4
    assert "holds 28 model tensors, this trainer trains 28, 28 of them differing" in other_rank


@pytest.mark.parametrize("resumed,reference", [("2to2", "ref2"), ("2to1", "ref2"), ("1to2", "ref1")])
def test_resume_continues_the_uninterrupted_run(runs, resumed, reference):
    results = runs[0]
    got, want = results[resumed], results[reference]
    assert got["version"] == K and got["last_epoch"] == K + M
    assert got["at_checkpoint"].keys() == want["at_checkpoint"].keys()
    for name, value in got["at_checkpoint"].items():  # loading is exact, whatever world saved it
        assert torch.equal(value, want["at_checkpoint"][name]), name
    assert got["lrs"] == want["lrs"]
    saved = want["draws"]
    assert all(torch.equal(a, saved[r % len(saved)]) for r, a in enumerate(got["draws"]))
    assert len(got["adapters"]) == ADAPTER_TENSORS
    for name, value in got["adapters"].items():
        assert torch.equal(value, want["adapters"][name]), name
    assert got["optim"].keys() == want["optim"].keys() and len(got["optim"]) == ADAPTER_TENSORS
    for name, state in got["optim"].items():
        assert float(state["step"]) == K + M
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], want["optim"][name][key]), (name, key)
    # the comparisons mean something: the M steps after the checkpoint moved every adapter
    moved = min(float((got["adapters"][n] - got["at_checkpoint"][n]).abs().max()) for n in got["adapters"])
    assert moved > 1e-4

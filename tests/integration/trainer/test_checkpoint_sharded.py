"""Sharded checkpoints (trainer/checkpoint.py) on real gloo ranks: each rank writes its own
shards, and a run resumed from a checkpoint, on the same or a different number of ranks,
continues exactly as the uninterrupted run does: parameters, AdamW state, the warmup + cosine
learning rate and every rank's RNG.

Three worlds run one after another (process start-up dominates the cost):
  2 ranks: `ref2` trains K steps, checkpoints at v=K into ck2, trains M more
  1 rank:  `2to1` resumes ck2 and trains M; `ref1` trains K, checkpoints into ck1, trains M more
  2 ranks: `2to2` resumes ck2 and trains M; `1to2` resumes ck1 and trains M
Every rank trains on the same batch, so FSDP's gradient average over ranks is the one rank's
gradient bit for bit, and with no gradient clipping (its norm sums squares in a rank-dependent
order) runs on 1 and 2 ranks are bit-identical: every comparison below is exact.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from spawned import finish_worker, gloo_rank, run_ranks

torch.set_num_threads(1)
K, M = 3, 3  # steps before the checkpoint, steps after it
LR, WARMUP, DECAY, MIN_RATIO = 1e-2, 2, 6, 0.1
# lr of updates K+1..K+M = 4, 5, 6, by hand: progress (n − 2) / (6 − 2) = 1/2, 3/4, 1, and
# f = 0.1 + 0.9 · ½ (1 + cos(π · progress)) = 0.1 + 0.45, 0.1 + 0.45 (1 − √½), 0.1
LRS_AFTER = [LR * 0.55, LR * (0.1 + 0.45 * (1 - math.sqrt(0.5))), LR * 0.1]


def train_step(model, opt, sched, v: int) -> None:
    g = torch.Generator().manual_seed(v)  # batch v is the same on every rank and in every run
    ids = torch.randint(3, 40, (2, 8), generator=g)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()


def run_job(d, model_dir, name: str, resume: Path | None = None, save: Path | None = None) -> dict | None:
    """One run on a fresh model: resume from `resume` or train K steps and checkpoint into `save`,
    then train to v = K + M. Rank 0 returns the full model, AdamW state, lrs and RNG draws."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from asyncrl.trainer.checkpoint import Checkpointer
    from asyncrl.trainer.model import build_model, full_state_dict
    from asyncrl.trainer.schedule import build_scheduler

    torch.manual_seed(100 + d.rank)  # a different RNG stream per rank: the checkpoint must keep each
    model = build_model(model_dir, d)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    sched = build_scheduler(opt, "cosine", WARMUP, DECAY, MIN_RATIO)
    if resume is not None:
        meta = Checkpointer(resume, d).load(model, opt, sched)
        version = meta.version
    else:
        for v in range(K):
            train_step(model, opt, sched, v)
        Checkpointer(save, d).save(model, opt, sched, K, [f"g{v}" for v in range(K)])
        version = K
    # the model as saved (reference) or as loaded (resumed); cloned: on one rank the full state
    # dict is the parameters themselves
    at_checkpoint = {k: v.clone() for k, v in full_state_dict(model).items()}
    draws = [torch.empty(3) for _ in range(d.world)]
    dist.all_gather(draws, torch.rand(3))  # where each rank's RNG stands right after save / load
    lrs = []
    for v in range(version, K + M):
        lrs.append(opt.param_groups[0]["lr"])
        train_step(model, opt, sched, v)
    model_state = full_state_dict(model)
    optim_state = get_optimizer_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if not d.is_main:
        return None
    return {"name": name, "version": version, "lrs": lrs, "draws": draws, "at_checkpoint": at_checkpoint,
            "model": model_state, "optim": optim_state["state"], "last_epoch": sched.last_epoch}  # fmt: skip


def worker(rank: int, world: int, port: int, model_dir: Path, jobs: list[dict], out: Path) -> None:
    with gloo_rank(rank, world, port) as d:
        for job in jobs:
            result = run_job(d, model_dir, **job)
            if d.is_main:
                torch.save(result, out / f"{job['name']}.pt")
    finish_worker()  # (only after a clean run: an exception above exits non-zero)


def launch(world: int, model_dir: Path, jobs: list[dict], out: Path) -> None:
    run_ranks(world, worker, model_dir, jobs, out, timeout_s=240)


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded")
    ck1, ck2 = out / "ck1", out / "ck2"
    launch(2, tiny, [{"name": "ref2", "save": ck2}], out)
    launch(1, tiny, [{"name": "2to1", "resume": ck2}, {"name": "ref1", "save": ck1}], out)
    launch(2, tiny, [{"name": "2to2", "resume": ck2}, {"name": "1to2", "resume": ck1}], out)
    names = ("ref2", "2to1", "ref1", "2to2", "1to2")
    return {n: torch.load(out / f"{n}.pt", weights_only=True) for n in names}, ck1, ck2


def test_each_rank_writes_its_own_shards(runs):
    _, ck1, ck2 = runs
    step = ck2 / f"step_{K:08d}"
    assert sorted(p.name for p in ck2.iterdir()) == [step.name]  # no temporary directory left
    shards = [step / f"__{r}_0.distcp" for r in range(2)]
    sizes = [p.stat().st_size for p in shards]
    # rank 1's file holds its half of every parameter and Adam moment: rank 0 gathered nothing
    assert min(sizes) > 0.4 * sum(sizes), sizes
    expected = {".metadata", "extra.pt", "meta.json", *(p.name for p in shards)}
    assert {p.name for p in step.iterdir()} == expected
    meta = json.loads((step / "meta.json").read_text())
    assert (meta["version"], meta["consumed_ids"], meta["world"]) == (K, ["g0", "g1", "g2"], 2)
    extra = torch.load(step / "extra.pt", weights_only=True)  # tensors and plain containers only
    assert extra["rng"].shape[0] == 2 and not torch.equal(extra["rng"][0], extra["rng"][1])
    assert extra["scheduler"]["last_epoch"] == K
    one_rank = ck1 / f"step_{K:08d}"
    assert json.loads((one_rank / "meta.json").read_text())["world"] == 1
    assert {p.name for p in one_rank.glob("*.distcp")} == {"__0_0.distcp"}


def test_uninterrupted_runs_follow_the_hand_computed_lr(runs):
    results = runs[0]
    for ref in ("ref1", "ref2"):
        assert results[ref]["lrs"] == pytest.approx(LRS_AFTER, rel=1e-12)
        assert results[ref]["last_epoch"] == K + M


@pytest.mark.parametrize("resumed,reference", [("2to2", "ref2"), ("2to1", "ref2"), ("1to2", "ref1")])
def test_resume_continues_the_uninterrupted_run(runs, resumed, reference):
    results = runs[0]
    got, want = results[resumed], results[reference]
    assert got["version"] == K and got["last_epoch"] == K + M
    for name, value in got["at_checkpoint"].items():  # loading is exact, whatever world saved it
        assert torch.equal(value, want["at_checkpoint"][name]), name
    assert got["lrs"] == want["lrs"]  # the resumed scheduler and param groups: the same floats
    # each rank continues its own RNG stream; on another world, rank r that of saved rank r mod saved world
    saved = want["draws"]
    assert all(torch.equal(a, saved[r % len(saved)]) for r, a in enumerate(got["draws"]))
    assert got["model"].keys() == want["model"].keys()
    for name, value in got["model"].items():
        assert torch.equal(value, want["model"][name]), name
    assert got["optim"].keys() == want["optim"].keys()
    for name, state in got["optim"].items():
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
        assert float(state["step"]) == K + M
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], want["optim"][name][key]), (name, key)
    # the comparisons mean something: the M steps after the checkpoint moved every tensor
    moved = min(float((got["model"][n] - got["at_checkpoint"][n]).abs().max()) for n in got["model"])
    assert moved > 1e-4

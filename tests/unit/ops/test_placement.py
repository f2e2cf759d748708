"""GPU placement (services/ops/placement.py) and the CUDA_VISIBLE_DEVICES each process `asyncrl up`
starts gets (Launcher.plan, built without starting anything)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from asyncrl.services.ops.launcher import Launcher
from asyncrl.services.ops.placement import (
    PlacementError,
    check_nccl_weight_group,
    parse_visible_devices,
    place,
    visible_gpus,
)
from asyncrl.services.ops.run_config import RunConfig

FOUR = ("0", "1", "2", "3")
EIGHT = tuple(str(i) for i in range(8))


# --- place ---------------------------------------------------------------------------------------


def test_automatic_split_puts_engines_first_and_the_trainer_after_them():
    p = place(FOUR, engines=2, trainer_nproc=2)
    assert p.engines == ((0,), (1,)) and p.trainer == (2, 3)
    assert [p.env(g) for g in p.engines] == [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}]
    assert p.env(p.trainer) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert p.env(()) == {"CUDA_VISIBLE_DEVICES": ""}  # a process that uses no GPU sees none
    assert p.describe() == "GPU placement (4 visible): engine-0: GPU 0; engine-1: GPU 1; trainer: GPUs 2,3"


def test_tensor_parallel_engines_get_contiguous_gpus_and_spare_gpus_stay_unused():
    # 2 engines × tp 2 = GPUs 0-3, trainer 2 ranks = 4,5; GPUs 6 and 7 are given to nobody
    p = place(EIGHT, engines=2, engine_tp=2, trainer_nproc=2)
    assert p.engines == ((0, 1), (2, 3)) and p.trainer == (4, 5)
    assert p.env(p.engines[1]) == {"CUDA_VISIBLE_DEVICES": "2,3"}


def test_explicit_lists_override_the_split():
    p = place(FOUR, engines=1, engine_tp=2, trainer_nproc=2, engine_gpus=[2, 3], trainer_gpus=[0, 1])
    assert p.engines == ((2, 3),) and p.trainer == (0, 1)
    # two tp-1 engines from one list: engine i takes entry i
    p = place(FOUR, engines=2, trainer_nproc=1, engine_gpus=[3, 1], trainer_gpus=[0])
    assert p.engines == ((3,), (1,)) and p.trainer == (0,)


def test_one_explicit_list_the_other_part_takes_the_gpus_it_leaves():
    p = place(FOUR, engines=2, trainer_nproc=1, trainer_gpus=[0])
    assert p.engines == ((1,), (2,)) and p.trainer == (0,)
    p = place(FOUR, engines=1, trainer_nproc=2, engine_gpus=[1])
    assert p.engines == ((1,),) and p.trainer == (0, 2)


def test_an_engine_and_the_trainer_on_one_gpu_is_refused_with_the_gpu_named():
    shared = r"GPU 1 is given to engine-0 and trainer: .*allow_shared_gpus = true"
    with pytest.raises(PlacementError, match=shared):
        place(FOUR, engines=1, trainer_nproc=2, engine_gpus=[1], trainer_gpus=[1, 2])
    with pytest.raises(PlacementError, match=r"GPU 2 is given to engine-0 and engine-1"):
        place(FOUR, engines=2, trainer_nproc=1, engine_gpus=[2, 2], trainer_gpus=[0])


def test_an_nccl_weight_group_needs_every_rank_on_its_own_gpu():
    """Trainer rank 0 and every engine rank join one NCCL group for a `distributed` publish: a
    GPU holding two of them (allowed sharing or not) or an engine on the CPU is refused."""
    check_nccl_weight_group(place(FOUR, engines=2, trainer_nproc=2), engines_on_gpu=True)  # 0,1 | 2,3: fine
    # rank 1 of the trainer may share with an engine: only rank 0 is in the weight group
    check_nccl_weight_group(place(FOUR, engines=1, trainer_nproc=2, engine_gpus=[1], trainer_gpus=[0, 1],
                                  allow_shared=True), engines_on_gpu=True)  # fmt: skip
    shared = place(FOUR, engines=1, trainer_nproc=1, engine_gpus=[2], trainer_gpus=[2], allow_shared=True)
    with pytest.raises(
        PlacementError, match=r"GPU 2 holds trainer rank 0 and engine-0.*broadcast_backend = \"gloo\""
    ):
        check_nccl_weight_group(shared, engines_on_gpu=True)
    engines_shared = place(
        FOUR, engines=2, trainer_nproc=1, engine_gpus=[1, 1], trainer_gpus=[0], allow_shared=True
    )
    with pytest.raises(PlacementError, match=r"GPU 1 holds engine-0 and engine-1"):
        check_nccl_weight_group(engines_shared, engines_on_gpu=True)
    with pytest.raises(PlacementError, match="engines on GPUs, but they run on the CPU"):
        check_nccl_weight_group(place(FOUR, engines=0, trainer_nproc=1), engines_on_gpu=False)
    check_nccl_weight_group(
        place((), engines=1, trainer_nproc=1), engines_on_gpu=False
    )  # no GPU: nothing to check


def test_the_launcher_refuses_an_nccl_publish_on_a_shared_gpu(tmp_path):
    """`asyncrl up` on one GPU with sharing allowed: publishing by NCCL broadcast is refused
    before anything starts; through host memory (gloo) or by disk it is placed."""
    import tomllib
    from pathlib import Path

    raw = tomllib.loads((Path(__file__).resolve().parents[3] / "configs" / "demo.toml").read_text())
    raw["launch"].update(gpus=1, allow_shared_gpus=True)
    raw["engine"]["device"] = "cuda"
    # (the trainer's own settings refuse a distributed publish without the engines to broadcast to)
    raw["trainer"].update(device="cuda", publish="distributed", engine_urls=["http://127.0.0.1:30000"])

    def placement(**trainer):
        cfg = {**raw, "trainer": {**raw["trainer"], **trainer}}
        return Launcher(RunConfig.model_validate(cfg), tmp_path / "x.toml", echo=False).placement

    with pytest.raises(PlacementError, match=r"GPU 0 holds trainer rank 0 and engine-0"):
        placement()
    assert placement(broadcast_backend="gloo").trainer == (0,)
    assert placement(publish="disk").engines == ((0,),)


def test_sharing_is_allowed_when_asked():
    p = place(FOUR, engines=1, trainer_nproc=2, engine_gpus=[1], trainer_gpus=[1, 2], allow_shared=True)
    assert p.engines == ((1,),) and p.trainer == (1, 2)
    assert p.describe().endswith("; shared: GPU 1")
    # automatic split on one GPU: the engine takes it, the trainer shares it
    p = place(("0",), engines=1, trainer_nproc=1, allow_shared=True)
    assert p.engines == ((0,),) and p.trainer == (0,)
    # 3 GPUs for 2 engines and 2 ranks: engines 0 and 1, the trainer 2 and then 0 again
    p = place(("0", "1", "2"), engines=2, trainer_nproc=2, allow_shared=True)
    assert p.engines == ((0,), (1,)) and p.trainer == (0, 2)


def test_too_few_gpus_are_refused():
    short = r"\(1 × engine_tp 1 = 1 GPU\) and the trainer \(1 GPU\) need 2 GPUs; 1 visible \(GPU 0\)\. "
    with pytest.raises(PlacementError, match=short + ".*allow_shared_gpus"):
        place(("0",), engines=1, trainer_nproc=1)
    # 2 engines × tp 2 + 1 rank = 5 > 4
    with pytest.raises(PlacementError, match=r"= 4 GPUs\) and the trainer \(1 GPU\) need 5 GPUs; 4 visible"):
        place(FOUR, engines=2, engine_tp=2, trainer_nproc=1)
    with pytest.raises(PlacementError, match=r"engine_gpus names GPU 4; 4 visible \(GPUs 0,1,2,3\)"):
        place(FOUR, engines=1, trainer_nproc=1, engine_gpus=[4], trainer_gpus=[0])
    # one process can never span more GPUs than exist, nor use one twice, shared or not
    with pytest.raises(PlacementError, match=r"engine_tp = 8 needs 8 distinct GPUs"):
        place(FOUR, engines=1, engine_tp=8, allow_shared=True)
    with pytest.raises(PlacementError, match=r"trainer_nproc_per_node = 5 needs 5 distinct GPUs"):
        place(FOUR, engines=0, trainer_nproc=5, allow_shared=True)
    with pytest.raises(PlacementError, match=r"trainer is given the same GPU twice \(GPUs 1,1\)"):
        place(FOUR, engines=0, trainer_nproc=2, trainer_gpus=[1, 1], allow_shared=True)


def test_explicit_lists_must_match_the_engines_and_ranks():
    wrong = r"engine_gpus lists 1 GPU\(s\); 1 GPU engine\(s\) × engine_tp 2 need 2"
    with pytest.raises(PlacementError, match=wrong):
        place(FOUR, engines=1, engine_tp=2, engine_gpus=[0])
    with pytest.raises(PlacementError, match=r"trainer_gpus lists 1 GPU\(s\); .*need 2"):
        place(FOUR, engines=0, trainer_nproc=2, trainer_gpus=[3])


def test_without_gpus_placement_is_a_no_op_and_refuses_nothing():
    p = place((), engines=2, engine_tp=4, trainer_nproc=8, engine_gpus=[0, 0], trainer_gpus=[0])
    assert p.engines == ((), ()) and p.trainer == ()
    assert p.env(p.trainer) == {} and p.env(()) == {}
    assert p.describe().startswith("no GPU visible")


def test_indices_map_to_the_launchers_own_visible_devices():
    devices = visible_gpus(None, {"CUDA_VISIBLE_DEVICES": "4,5,7"})
    assert devices == ("4", "5", "7")
    p = place(devices, engines=1, trainer_nproc=2)
    assert p.env(p.engines[0]) == {"CUDA_VISIBLE_DEVICES": "4"}
    assert p.env(p.trainer) == {"CUDA_VISIBLE_DEVICES": "5,7"}
    said = "engine-0: GPU 0 (CUDA_VISIBLE_DEVICES 4); trainer: GPUs 1,2 (CUDA_VISIBLE_DEVICES 5,7)"
    assert said in p.describe()
    shared = r"GPU 0 \(CUDA_VISIBLE_DEVICES 4\) is given to engine-0 and trainer"
    with pytest.raises(PlacementError, match=shared):
        place(devices, engines=1, trainer_nproc=1, engine_gpus=[0], trainer_gpus=[0])


def test_visible_gpus_reads_cuda_visible_devices_or_the_configured_count():
    assert visible_gpus(2, {"CUDA_VISIBLE_DEVICES": "4,5,7"}) == ("4", "5")
    assert visible_gpus(3, {}) == ("0", "1", "2")
    assert visible_gpus(0, {}) == ()
    with pytest.raises(PlacementError, match=r"gpus = 3, but CUDA_VISIBLE_DEVICES='4,5' makes 2 visible"):
        visible_gpus(3, {"CUDA_VISIBLE_DEVICES": "4,5"})
    assert parse_visible_devices("") == () and parse_visible_devices("-1") == ()
    assert parse_visible_devices(" 0, 2 ,-1,3") == ("0", "2")  # CUDA stops at the first invalid entry
    assert parse_visible_devices("GPU-8f1c,GPU-77aa") == ("GPU-8f1c", "GPU-77aa")


# --- the launcher ---------------------------------------------------------------------------------


def launcher(tmp_path, monkeypatch, launch: dict, **tables) -> Launcher:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    raw = {"run": {"dir": str(tmp_path / "run"), "redis_url": "redis://127.0.0.1:1/0"},
           "model": {"path": str(tmp_path / "model")}, "launch": launch, **tables}  # fmt: skip
    return Launcher(RunConfig.model_validate(raw), tmp_path / "run.toml", echo=False)


def visible(launcher: Launcher) -> dict[str, str | None]:
    return {p.name: p.env.get("CUDA_VISIBLE_DEVICES") for stage in launcher.plan() for p in stage}


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_launcher_gives_each_process_its_gpus(tmp_path, monkeypatch):
    up = launcher(tmp_path, monkeypatch, {"gpus": 8, "engine_kind": "sglang", "engines": 2, "engine_tp": 2,
                                          "trainer_nproc_per_node": 3, "rollout_replicas": 2})  # fmt: skip
    assert visible(up) == {"reward-0": "", "engine-0": "0,1", "engine-1": "2,3", "rollout-0": "", "rollout-1": "",
                           "trainer": "4,5,6"}  # fmt: skip
    procs = {p.name: p for stage in up.plan() for p in stage}
    engine = procs["engine-1"].cmd
    assert flag(engine, "--tp-size") == "2" and flag(engine, "--port") == "30001"
    assert flag(procs["trainer"].cmd, "--nproc-per-node") == "3"  # one rank per GPU it was given


def test_launcher_follows_explicit_lists_and_its_own_cuda_visible_devices(tmp_path, monkeypatch):
    up = launcher(tmp_path, monkeypatch, {"gpus": 4, "engine_gpus": [3], "trainer_gpus": [0, 1],
                                          "trainer_nproc_per_node": 2})  # fmt: skip
    assert visible(up) == {"reward-0": "", "engine-0": "3", "rollout-0": "", "trainer": "0,1"}
    up = launcher(tmp_path, monkeypatch, {})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7")  # `gpus` unset: the launcher's own GPUs, no nvidia-smi
    assert visible(up) == {"reward-0": "", "engine-0": "6", "rollout-0": "", "trainer": "7"}


def test_launcher_gives_no_gpu_to_services_on_the_cpu(tmp_path, monkeypatch):
    up = launcher(tmp_path, monkeypatch, {"gpus": 1}, engine={"device": "cpu"})
    assert visible(up) == {"reward-0": "", "engine-0": "", "rollout-0": "", "trainer": "0"}
    up = launcher(tmp_path, monkeypatch, {"gpus": 1}, trainer={"device": "cpu", "lr": 0.1})
    assert visible(up) == {"reward-0": "", "engine-0": "0", "rollout-0": "", "trainer": ""}
    up = launcher(tmp_path, monkeypatch, {"gpus": 2, "engine_urls": ["http://gpu-node:30000"]})
    # external engines: no engine started here
    assert visible(up) == {"reward-0": "", "rollout-0": "", "trainer": "0"}


def test_launcher_refuses_a_shared_gpu_unless_asked(tmp_path, monkeypatch):
    up = launcher(tmp_path, monkeypatch, {"gpus": 1})
    with pytest.raises(PlacementError, match=r"need 2 GPUs; 1 visible \(GPU 0\)"):
        up.plan()
    up = launcher(tmp_path, monkeypatch, {"gpus": 2, "engine_gpus": [1], "trainer_gpus": [1]})
    with pytest.raises(PlacementError, match="GPU 1 is given to engine-0 and trainer"):
        up.plan()
    up = launcher(tmp_path, monkeypatch, {"gpus": 1, "allow_shared_gpus": True})
    assert visible(up) == {"reward-0": "", "engine-0": "0", "rollout-0": "", "trainer": "0"}


def test_launcher_on_the_cpu_sets_no_cuda_variable(tmp_path, monkeypatch):
    up = launcher(tmp_path, monkeypatch, {"gpus": 0, "engines": 2, "trainer_nproc_per_node": 4,
                                          "engine_gpus": [0, 0], "trainer_gpus": [0]})  # fmt: skip
    assert visible(up) == dict.fromkeys(["reward-0", "engine-0", "engine-1", "rollout-0", "trainer"])


@pytest.mark.parametrize("launch,match", [
    ({"engine_kind": "sglang", "engine_args": ["--tp", "2"]}, "may not set --tp: .*engine_tp"),
    ({"engine_kind": "sglang", "engine_args": ["--tp-size=2"]}, "may not set --tp-size"),
    ({"engine_kind": "sglang", "engine_args": ["--dp-size", "2"]}, "may not set --dp-size: .*engines for data"),
    ({"engine_kind": "reference", "engine_tp": 2}, 'engine_tp > 1 needs engine_kind = "sglang"'),
    ({"engine_gpus": [-1]}, "greater than or equal to 0"),
])  # fmt: skip
def test_launch_settings_refuse_gpu_flags_the_launcher_owns(launch, match):
    with pytest.raises(ValidationError, match=match):
        RunConfig.model_validate({"model": {"path": "/m"}, "launch": launch})


def test_a_reference_engine_pinned_to_another_cuda_device_is_refused(tmp_path, monkeypatch):
    up = launcher(tmp_path, monkeypatch, {"gpus": 2}, engine={"device": "cuda:1"})
    with pytest.raises(PlacementError, match=r"device = 'cuda:1': each engine sees only its own GPU"):
        up.plan()

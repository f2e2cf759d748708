"""Weight-version lineage (proto/lineage.py): names, the lost-history rule, and the disk
publisher's directories of two histories."""

from __future__ import annotations

import pytest
import torch

from asyncrl.proto.lineage import Lineage
from asyncrl.services.transport.weights import adapter_name, parse_weight_version, weight_version_name
from asyncrl.trainer.publish import DiskPublisher


@pytest.mark.parametrize(("version", "epoch", "name"), [(0, 0, "0"), (466, 0, "466"), (460, 2, "460@e2")])
def test_weight_version_names_round_trip(version, epoch, name):
    assert weight_version_name(version, epoch) == name
    assert parse_weight_version(name) == (version, epoch)


def test_adapter_names_tell_runs_versions_and_histories_apart():
    assert adapter_name("demo", 466) == "demo-466"
    assert adapter_name("demo", 466, 2) == "demo-466@e2"
    names = {adapter_name(run, v, e) for run in ("a", "b") for v in (1, 2) for e in (0, 1)}
    assert len(names) == 8


@pytest.mark.parametrize("name", [None, "", "default", "3@e", "@e2", "3@x2", "-1", "3.5", "3@e2@e1"])
def test_other_weight_versions_are_not_policy_versions(name):
    assert parse_weight_version(name) is None


def test_a_token_is_lost_when_a_later_epoch_forked_below_it():
    # epoch 0 ran to v466, resumed at 460 (epoch 1), which ran to v470 and resumed at 465 (epoch 2)
    lineage = Lineage(epoch=2, forks={1: 460, 2: 465})
    assert lineage.cutoff(0) == 460 and lineage.cutoff(1) == 465 and lineage.cutoff(2) == float("inf")
    assert not lineage.lost({0: 460})  # at the fork: shared by both histories
    assert lineage.lost({0: 461})
    assert not lineage.lost({1: 465, 2: 480})
    assert lineage.lost({1: 466})
    assert lineage.lost({0: 100, 1: 470, 2: 466})  # one lost token is enough
    assert not Lineage().lost({0: 10**6})  # a run never resumed loses nothing


def test_disk_publisher_keeps_histories_apart(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    pub = DiskPublisher(tmp_path / "w", src, keep=3)
    state = {"w": torch.zeros(2)}
    for v in (1, 2, 3, 4):
        pub.write(v, {"w": torch.full((2,), float(v))})
    # resumed at v2 in epoch 1: epoch 0's v3, v4 are a lost history; v2 of epoch 0 stays as it was
    out = pub.write(2, state, epoch=1)
    assert out.path.endswith("v00000002-e1")
    names = sorted(p.name for p in (tmp_path / "w").iterdir())
    assert names == ["v00000002", "v00000002-e1"]  # (v1 pruned earlier: keep=3)
    from safetensors.torch import load_file

    assert load_file(tmp_path / "w" / "v00000002" / "model.safetensors")["w"].tolist() == [2.0, 2.0]
    pub.write(3, state, epoch=1)
    pub.write(4, state, epoch=1)
    # pruning follows publication order (epoch, version), not names
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == [
        "v00000002-e1",
        "v00000003-e1",
        "v00000004-e1",
    ]

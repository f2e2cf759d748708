"""`asyncrl train`'s torchrun command for a node of a multi-host run: the c10d rendezvous options
reach torchrun as given (read back with torchrun's own parser), the worker gets the rest.
tests/e2e/test_two_node_trainer.py runs this command on two network namespaces."""

from __future__ import annotations

import os

import pytest
from torch.distributed.run import get_args_parser

import asyncrl.trainer.main as launcher


class Exec(Exception):
    pass


def torchrun_command(argv: list[str], monkeypatch) -> list[str]:
    def execv(path, cmd):
        raise Exec(cmd)

    monkeypatch.setattr(launcher.os, "execv", execv)
    for name in ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "OMP_NUM_THREADS"):  # restored after the test
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(Exec) as caught:
        launcher.main(argv)
    # torchrun (exec'd with this environment) gives each rendezvous round a fresh store
    assert os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    return caught.value.args[0]


def test_rendezvous_options_pass_through(tmp_path, monkeypatch):
    cfg = tmp_path / "run.toml"
    cfg.write_text('[trainer]\nmodel_path = "/m"\n')
    cmd = torchrun_command(
        ["--config", str(cfg), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", "10.77.0.1:29400", "--rdzv-id", "run-7", "--rdzv-conf", "is_host=true",
         "--local-addr", "10.77.0.1", "--max-restarts", "3"],
        monkeypatch,
    )  # fmt: skip
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    args = get_args_parser().parse_args(cmd[3:])
    got = (args.nnodes, args.nproc_per_node, args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id,
           args.rdzv_conf, args.local_addr, args.max_restarts, args.standalone)  # fmt: skip
    assert got == ("2", "1", "c10d", "10.77.0.1:29400", "run-7", "is_host=true", "10.77.0.1", 3, False)
    assert (args.module, args.training_script) == (True, "asyncrl.trainer.main")
    assert args.training_script_args == ["--worker", "--config", str(cfg)]  # the rest, to the worker


def test_a_single_host_run_stays_standalone(tmp_path, monkeypatch):
    cfg = tmp_path / "run.toml"
    cfg.write_text('[trainer]\nmodel_path = "/m"\n')
    args = get_args_parser().parse_args(torchrun_command(["--config", str(cfg)], monkeypatch)[3:])
    assert (args.standalone, args.rdzv_conf, args.local_addr) == (True, "", None)

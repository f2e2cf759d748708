"""`asyncrl train --config FILE [--nproc-per-node N]`: validate the config, then run torchrun.

The launcher process only parses and checks settings (no torch import) and execs
`python -m torch.distributed.run … -m asyncrl.trainer.main --worker …`; each worker joins the process
group and runs trainer/loop.py. Extra torchrun options (`--nnodes`, `--node-rank`,
`--rdzv-endpoint`, `--rdzv-backend`, `--rdzv-conf`, `--local-addr`, `--master-port`) pass through
for multi-node runs. Across hosts, `--local-addr` is the address the other nodes reach this one
at (torchrun's default, the FQDN, may resolve to a loopback or unrelated address there) and
`--rdzv-conf is_host=true` marks the node that serves the c10d store when the endpoint's
address does not name this host's hostname.
"""

from __future__ import annotations

import argparse
import os
import sys

TORCHRUN_FLAGS = (
    "--nnodes",
    "--node-rank",
    "--rdzv-endpoint",
    "--rdzv-backend",
    "--rdzv-id",
    "--master-port",
    "--master-addr",
    "--max-restarts",
    "--rdzv-conf",
    "--local-addr",
)


def _split(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--nproc-per-node", default="1")
    parser.add_argument("--worker", action="store_true")
    for flag in TORCHRUN_FLAGS:
        parser.add_argument(flag)
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # what follows torchrun's `--` separator
        argv = argv[1:]
    launch, rest = _split(argv)
    if launch.worker:
        return worker(rest)
    from asyncrl.services.runtime.config import load_settings
    from asyncrl.trainer.config import TrainerSettings

    load_settings(
        TrainerSettings, rest, prog="asyncrl train", section="trainer"
    )  # fails fast, or --print-config
    # torchrun's agent polls its workers every 0.1 s by default; once a second still notices a
    # dead worker promptly and leaves the cores to the work.
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={launch.nproc_per_node}",
        "--monitor-interval=1",
    ]
    passthrough = {f: getattr(launch, f[2:].replace("-", "_")) for f in TORCHRUN_FLAGS}
    cmd += [f"{f}={v}" for f, v in passthrough.items() if v is not None]
    if launch.nnodes is None and launch.rdzv_endpoint is None:
        cmd.append("--standalone")
    # `--` ends torchrun's own options: its parser would otherwise take e.g. `--run` as an
    # ambiguous abbreviation of `--run-path` even after the module name.
    cmd += ["-m", "asyncrl.trainer.main", "--", "--worker", *rest]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # A fresh c10d store per rendezvous round, hosted by that round's rank 0 worker. torchrun's
    # default shares the agent's store across rounds with no per-round prefix, so after a worker
    # restart a rank can read the previous round's keys (rank 0's old gloo address: "Connection
    # refused", three restarts in a row, seen across two hosts here).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    os.execv(sys.executable, cmd)  # replaces this process: signals reach torchrun directly
    return 0  # unreachable


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when torchrun dies, so a killed trainer leaves no orphan rank
    training on (and holding its buffer consumer) behind it."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def worker(argv: list[str]) -> int:
    _die_with_parent()
    from asyncrl.services.runtime.config import load_settings
    from asyncrl.services.runtime.logging import setup_logging
    from asyncrl.trainer.config import TrainerSettings

    cfg = load_settings(TrainerSettings, argv, prog="asyncrl train", section="trainer")
    setup_logging(cfg.log_level)
    os.environ.setdefault("ASYNCRL_RUN", cfg.run)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from asyncrl.services.runtime.heap_freeze import freeze_startup_heap
    from asyncrl.trainer import metrics as tm
    from asyncrl.trainer.loop import train
    from asyncrl.trainer.model import init_distributed
    from asyncrl.trainer.parts import build

    # torchrun (`--max-restarts`) restarts every worker after one fails; each restart resumes
    # from the last durable checkpoint (trainer/loop.py) and rides out a Redis restart on the way
    # (buffer/connection.py): a dead worker or a restarted Redis costs the steps since that
    # checkpoint, never a group trained twice.
    tm.WORKER_RESTARTS.set(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    ranks = init_distributed(cfg.device, cfg.dist_timeout_s)
    torch.manual_seed(cfg.seed + ranks.rank)
    parts = build(cfg, ranks)
    parts.source.install_signal_handlers()
    freeze_startup_heap()  # the model, optimizer and modules: never again walked by a full collection
    try:
        return train(parts)
    finally:
        dist.destroy_process_group()


def _exit_now(code: int) -> None:
    """Leave a worker without interpreter finalization. Gloo's C++ threads can still hold
    work objects with tensors at that point, and freeing them while the interpreter is torn
    down aborts the process ("terminate called without an active exception", exit -6), which
    turned a finished run into a failed one now and then. Everything durable (checkpoints,
    acks, logs) is written by the time `worker` returns."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    if "--worker" in sys.argv[1:]:
        try:
            code = main()
        except SystemExit as exc:  # argparse and friends
            if isinstance(exc.code, str):
                print(exc.code, file=sys.stderr)
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except Exception:  # noqa: BLE001 — printed as Python would, then the exit code says it
            import traceback

            traceback.print_exc()
            code = 1
        _exit_now(int(code or 0))
    sys.exit(main())

"""`asyncrl train` in a fresh interpreter: a bad config is refused before torchrun starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_cli_rejects_bad_config_before_starting_torchrun(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[trainer]\nmodel_path = "/m"\nmax_staleness = -1\n')
    res = subprocess.run([sys.executable, "-m", "asyncrl.services.ops.cli", "train", "--config", str(cfg)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert res.returncode != 0
    assert "max_staleness" in res.stderr and "torch.distributed.run" not in res.stderr

"""benchmarks/lora_vs_full.py's figures: medians per arm, LoRA/full ratios paired round by round,
the process's peak memory, the bytes target and the first-loss check, from hand-made records."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[3] / "benchmarks" / "lora_vs_full.py"
spec = importlib.util.spec_from_file_location("lora_vs_full", PATH)
bench = importlib.util.module_from_spec(spec)
sys.modules["lora_vs_full"] = bench
spec.loader.exec_module(bench)


def record(step_s, publish_s, publish_bytes, peak_rss_mb, loss=0.5, opt_bytes=8):
    return {
        "step_s": step_s,
        "forward_backward_s": step_s * 0.8,
        "optimizer_s": step_s * 0.2,
        "publish_s": publish_s,
        "publish_blocking_s": publish_s / 10,
        "publish_bytes": publish_bytes,
        "publish_files": ["model.safetensors"],
        "peak_rss_mb": peak_rss_mb,
        "loss": loss,
        "optimizer_state_bytes": opt_bytes,
    }


def ready(build_peak, params, trainable):
    return {"compute_dtype": "float32", "lr": 1e-4, "build_peak_rss_mb": build_peak, "parameters": params,
            "trainable_parameters": trainable}  # fmt: skip


@pytest.fixture
def figures():
    # three rounds; the machine got slower in round 2 (both arms 2x): paired ratios ignore it
    runs = {
        "full": [record(10.0, 2.0, 540, 3000), record(20.0, 4.0, 540, 3100), record(10.0, 2.0, 540, 2900)],
        "lora": [record(6.0, 0.1, 20, 1200), record(12.0, 0.2, 20, 1300), record(7.0, 0.1, 20, 1100)],
    }
    warm = {"full": record(30.0, 3.0, 540, 2800, loss=0.25, opt_bytes=1000),
            "lora": record(25.0, 0.3, 20, 1000, loss=0.25 + 1e-6, opt_bytes=40)}  # fmt: skip
    return bench.summarize(runs, {"full": ready(3500, 135, 135), "lora": ready(900, 140, 5)}, warm)


def test_medians_and_peaks_per_arm(figures):
    full, lora = figures["arms"]["full"], figures["arms"]["lora"]
    assert full["median_step_s"] == 10.0  # of 10, 20, 10
    assert lora["median_step_s"] == 7.0  # of 6, 12, 7
    assert full["median_publish_s"] == 2.0 and lora["median_publish_s"] == 0.1
    assert full["median_publish_blocking_s"] == 0.2
    assert full["warmup_step_s"] == 30.0  # reported, not in the medians
    # the process's peak: building (3,500) above every step for full; a step (1,300) for LoRA
    assert full["peak_rss_mb"] == 3500 and full["step_peak_rss_mb"] == 3100
    assert lora["peak_rss_mb"] == 1300 and lora["step_peak_rss_mb"] == 1300
    assert lora["trainable_parameters"] == 5 and lora["parameters"] == 140
    assert lora["optimizer_state_bytes"] == 40  # counted after the warm-up
    assert full["cuda_peak_mb"] is None


def test_ratios_are_paired_round_by_round(figures):
    ratio = figures["lora_over_full"]
    # per round 6/10 = 0.6, 12/20 = 0.6, 7/10 = 0.7: median 0.6 (the unpaired medians give 7/10)
    assert ratio["step_s"] == pytest.approx(0.6)
    assert ratio["publish_s"] == pytest.approx(0.05)  # 0.1/2, 0.2/4, 0.1/2
    assert ratio["publish_bytes"] == pytest.approx(20 / 540)
    assert ratio["peak_rss_mb"] == pytest.approx(1300 / 3500)
    assert ratio["trainable_parameters"] == pytest.approx(5 / 135)
    assert ratio["optimizer_state_bytes"] == pytest.approx(40 / 1000)


def test_bytes_target_and_first_loss_check(figures):
    assert figures["publish_bytes_full_over_lora"] == pytest.approx(27.0)  # 540 / 20
    assert figures["bytes_target"] == {"full_over_lora_at_least": 20.0, "met": True}
    assert figures["first_loss_rel_diff"] == pytest.approx(4e-6)  # 1e-6 / 0.25
    assert figures["same_first_loss"] is True


def test_bytes_target_missed_below_20x():
    runs = {"full": [record(1.0, 1.0, 100, 10)], "lora": [record(1.0, 1.0, 10, 10, loss=0.7)]}
    warm = {"full": record(1.0, 1.0, 100, 10, loss=0.5), "lora": record(1.0, 1.0, 10, 10, loss=0.6)}
    out = bench.summarize(runs, {"full": ready(1, 1, 1), "lora": ready(1, 1, 1)}, warm)
    assert out["publish_bytes_full_over_lora"] == pytest.approx(10.0)
    assert out["bytes_target"]["met"] is False
    assert out["first_loss_rel_diff"] == pytest.approx(0.2)  # 0.1 / 0.5
    assert out["same_first_loss"] is False


def test_table_rows_carry_both_arms_and_the_ratio(figures):
    lines = bench.table(figures).splitlines()
    assert lines[0] == "| measure | full | LoRA | LoRA/full |"
    assert "| trainer s/step (median) | 10.00 | 7.00 | 0.6 |" in lines
    assert "| publish bytes / version | 540 | 20 | 0.037 |" in lines
    assert "| trainable parameters | 135 | 5 | 0.037 |" in lines
    assert len(lines) == 12  # header, rule, ten measures (no CUDA row on the CPU)

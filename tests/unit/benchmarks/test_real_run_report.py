"""benchmarks/real_run_report.py's gain over the base model with its interval over the items."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[3] / "benchmarks"
sys.path.insert(0, str(HERE))  # the report imports real_vs_trl from its own folder
spec = importlib.util.spec_from_file_location("real_run_report", HERE / "real_run_report.py")
report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report)


def write(run: Path, name: str, version: int, rows: list[tuple[bool, bool]]) -> None:
    (run / "evals").mkdir(exist_ok=True)
    lines = [
        json.dumps({"prompt_id": f"p{i}", "correct": c, "formatted": f, "tokens": 9})
        for i, (c, f) in enumerate(rows)
    ]
    (run / "evals" / f"{name}-v{version}.jsonl").write_text("\n".join(lines) + "\n")


def test_the_gain_is_paired_item_by_item(tmp_path):
    # 10 problems: the base gets 2 right (formatted), version 10 gets those and 3 more.
    base = [(True, True), (True, True)] + [(False, False)] * 8
    now = (
        [(True, True), (True, True), (True, True), (True, True), (True, True)]
        + [(False, True)] * 2
        + [(False, False)] * 3
    )
    write(tmp_path, "heldout", 0, base)
    write(tmp_path, "heldout", 10, now)
    got = report.paired_gain(report.items(tmp_path, "heldout", 0), report.items(tmp_path, "heldout", 10))
    half = 1.96 * math.sqrt(0.3 * 0.7) / math.sqrt(10)  # changes: three +1, seven 0
    assert got.split(" | ")[0] == f"+0.300 [{0.3 - half:+.3f}, {0.3 + half:+.3f}]"
    # among formatted: 2/2 = 1.0 at the base, 5/7 now
    p0, p1 = 1.0, 5 / 7
    half_f = 1.96 * math.sqrt(p1 * (1 - p1) / 7)
    assert got.split(" | ")[1] == f"{p1 - p0:+.3f} [{p1 - p0 - half_f:+.3f}, {p1 - p0 + half_f:+.3f}]"


def test_a_problem_missing_from_one_side_is_left_out_and_no_items_is_a_dash(tmp_path):
    write(tmp_path, "heldout", 0, [(False, False), (True, True)])
    write(tmp_path, "heldout", 5, [(True, True)])  # only p0, which flipped to right
    got = report.paired_gain(report.items(tmp_path, "heldout", 0), report.items(tmp_path, "heldout", 5))
    assert got.startswith("+1.000 [+1.000, +1.000]")
    assert report.paired_gain(None, report.items(tmp_path, "heldout", 5)) == "-"
    assert report.items(tmp_path, "heldout-hard", 0) is None

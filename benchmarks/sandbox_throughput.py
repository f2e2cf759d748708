"""Sandboxed executions/s per core (bubblewrap + rlimits, the code verifier's path) vs a bare
`python3 -I -B -c` subprocess (same interpreter, same flags) in the same run, and math
verifications/s through the worker pool.

    .venv/bin/python benchmarks/sandbox_throughput.py [--runs 100] [--math 200]

Runs are sequential (one at a time: per core) and interleaved, one bare run then one sandboxed
run, so that load from other work on the box hits both alike; rates are 1 / median time per
run. Prints a markdown table. Target: sandbox/bare ratio >= 0.7.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import subprocess
import time

from services.reward.sandbox import Limits, Sandbox
from services.reward.verifiers.math import MathVerifier

PROGRAM = "print(sum(range(10)))"
PYTHON = "/usr/bin/python3"
WARMUP_RUNS = 5  # page cache, first-use costs


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def bare_once() -> tuple[float, float]:
    """(wall s, CPU s of the child)."""
    cpu, started = children_cpu_s(), time.perf_counter()
    out = subprocess.run([PYTHON, "-I", "-B", "-c", PROGRAM], capture_output=True, check=True)
    assert out.stdout == b"45\n"
    return time.perf_counter() - started, children_cpu_s() - cpu


async def sandbox_vs_bare(runs: int) -> dict[str, list[float]]:
    """Per-run wall and child-CPU seconds, bare and sandboxed, interleaved. The sandbox's CPU is
    that of every process it waits for (nsenter/bwrap, the program as the sandbox's pid 1), not
    kernel work done elsewhere (namespace teardown in kernel workers) nor this process's own."""
    sandbox = Sandbox(python=PYTHON, slots=1, uid_base=2_200_000)
    limits = Limits(
        wall_s=10,
        cpu_s=10,
        memory_mb=512,
        fsize_mb=16,
        nofile=64,
        nproc=32,
        output_bytes=1 << 16,
        tmpfs_mb=16,
    )
    times: dict[str, list[float]] = {"bare": [], "boxed": [], "bare_cpu": [], "boxed_cpu": []}
    for i in range(runs + WARMUP_RUNS):
        bare, bare_cpu = bare_once()
        cpu, started = children_cpu_s(), time.perf_counter()
        result = await sandbox.run({"main.py": PROGRAM}, ["main.py"], "", limits)
        boxed, boxed_cpu = time.perf_counter() - started, children_cpu_s() - cpu
        assert result.outcome == "exited" and result.stdout == b"45\n", result
        if i >= WARMUP_RUNS:
            for key, value in zip(times, (bare, boxed, bare_cpu, boxed_cpu)):
                times[key].append(value)
    return times


async def math_rate(n: int) -> float:
    verifier = MathVerifier(workers=1, timeout_s=10, max_chars=8192, memory_mb=2048)
    await verifier.start()
    try:
        cases = [(f"\\frac{{{i}}}{{2}}", f"so the answer is \\boxed{{{i / 2}}}") for i in range(n)]
        started = time.perf_counter()
        for gold, completion in cases:
            verdict = await verifier.verify(verifier.parse_spec({"answer": gold}), "", completion)
            assert verdict.reward == 1.0, verdict
        return n / (time.perf_counter() - started)
    finally:
        await verifier.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--math", type=int, default=200)
    args = parser.parse_args()
    times = asyncio.run(sandbox_vs_bare(args.runs))
    bare_s, boxed_s = times["bare"], times["boxed"]
    bare, boxed = 1 / statistics.median(bare_s), 1 / statistics.median(boxed_s)
    bare_cpu, boxed_cpu = statistics.median(times["bare_cpu"]), statistics.median(times["boxed_cpu"])
    pairs = sorted(b / s for b, s in zip(bare_s, boxed_s))
    maths = asyncio.run(math_rate(args.math))
    print(f"cpus={os.cpu_count()} runs={args.runs} interleaved (one at a time: executions/s per core)\n")
    print("| measure | value |\n|---|---|")
    print(f"| bare `python3 -I -B -c` subprocess, exec/s per core (median) | {bare:.1f} |")
    print(f"| bubblewrap sandbox (rlimits, uid drop, tmpfs), exec/s per core (median) | {boxed:.1f} |")
    print(f"| ratio sandbox / bare (target >= 0.7) | {boxed / bare:.2f} |")
    quartiles = " / ".join(f"{pairs[len(pairs) * q // 4]:.2f}" for q in (1, 2, 3))
    print(f"| per-pair ratio sandbox / bare, quartiles | {quartiles} |")
    print(f"| ratio of totals (sum bare s / sum sandbox s) | {sum(bare_s) / sum(boxed_s):.2f} |")
    cpu_ms = f"{bare_cpu * 1e3:.1f} / {boxed_cpu * 1e3:.1f}"
    print(f"| CPU per run, bare / sandbox (median ms, child processes) | {cpu_ms} |")
    print(f"| CPU-bound ratio (bare CPU / sandbox CPU) | {bare_cpu / boxed_cpu:.2f} |")
    print(f"| math-verify checks/s (1 worker process) | {maths:.1f} |")


if __name__ == "__main__":
    main()

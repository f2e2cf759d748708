"""Sandboxed executions/s per core (bubblewrap + rlimits, the code verifier's path) vs a bare
`python3 -I -B -c` subprocess (same interpreter, same flags) in the same run; `assert_code`
items/s through the code verifier with split asserts (calls in the sandbox, comparisons in the
service) vs the same asserts run in the sandbox as written; and math verifications/s through
the worker pool.

    .venv/bin/python benchmarks/sandbox_throughput.py [--runs 100] [--asserts 100] [--math 200]

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

from asyncrl.services.reward.sandbox import Limits, Sandbox
from asyncrl.services.reward.verifiers.code import CodeVerifier
from asyncrl.services.reward.verifiers.math import MathVerifier

PROGRAM = "print(sum(range(10)))"
PYTHON = "/usr/bin/python3"
WARMUP_RUNS = 5  # page cache, first-use costs
SOLUTION = "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
ASSERTS = "\n".join(f"assert fib({n}) == {a}" for n, a in enumerate([0, 1, 1, 2, 3, 5, 8, 13, 21, 34]))
UNSPLITTABLE = "import os  # never evaluated by the split: the same asserts, run in the sandbox\n"


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


async def asserts_split_vs_in_sandbox(runs: int) -> dict[str, list[float]]:
    """Per-item seconds of `CodeVerifier.verify` on a 10-assert item, split and in sandbox,
    interleaved (parsing, the sandbox run, reading and judging the results included)."""
    sandbox = Sandbox(python=PYTHON, slots=1, uid_base=2_200_000)
    verifier = CodeVerifier(
        sandbox, concurrency=1, item_timeout_s=30, max_test_timeout_s=10, max_memory_mb=512, max_tests=16,
        output_bytes=1 << 16, tmpfs_mb=16, max_procs=32, max_files=64,
    )  # fmt: skip
    specs = {
        "split": verifier.parse_spec({"assert_code": ASSERTS}),
        "in_sandbox": verifier.parse_spec({"assert_code": UNSPLITTABLE + ASSERTS}),
    }
    times: dict[str, list[float]] = {mode: [] for mode in specs}
    for i in range(runs + WARMUP_RUNS):
        for mode, spec in specs.items():
            started = time.perf_counter()
            verdict = await verifier.verify(spec, "", SOLUTION)
            elapsed = time.perf_counter() - started
            assert (verdict.reward, verdict.details["asserts"]) == (1.0, mode), verdict
            if i >= WARMUP_RUNS:
                times[mode].append(elapsed)
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
    parser.add_argument("--asserts", type=int, default=100, help="assert_code items per mode")
    parser.add_argument("--math", type=int, default=200)
    args = parser.parse_args()
    times = asyncio.run(sandbox_vs_bare(args.runs))
    asserts = asyncio.run(asserts_split_vs_in_sandbox(args.asserts))
    bare_s, boxed_s = times["bare"], times["boxed"]
    bare, boxed = 1 / statistics.median(bare_s), 1 / statistics.median(boxed_s)
    bare_cpu, boxed_cpu = statistics.median(times["bare_cpu"]), statistics.median(times["boxed_cpu"])
    pairs = sorted(b / s for b, s in zip(bare_s, boxed_s))
    maths = asyncio.run(math_rate(args.math))
    sizes = f"runs={args.runs} asserts={args.asserts}"
    print(f"cpus={os.cpu_count()} {sizes} interleaved (one at a time: executions/s per core)\n")
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
    split, in_sandbox = (1 / statistics.median(asserts[mode]) for mode in ("split", "in_sandbox"))
    print(f"| code verifier, 10 asserts split (compared in the service), items/s (median) | {split:.1f} |")
    print(f"| code verifier, same 10 asserts run in the sandbox, items/s (median) | {in_sandbox:.1f} |")
    print(f"| ratio split / in sandbox | {split / in_sandbox:.2f} |")
    print(f"| math-verify checks/s (1 worker process) | {maths:.1f} |")


if __name__ == "__main__":
    main()

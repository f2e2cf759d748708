"""`code` verifier: run the completion's program in the bubblewrap sandbox against tests.

The program is the last fenced code block of the completion (else the whole completion).
* stdin/stdout tests: each test runs the program on its stdin; stdout is compared outside the
  sandbox after whitespace normalisation (trailing spaces per line and surrounding blank lines
  ignored). Expected outputs never enter the sandbox.
* `assert_code`, split (details `asserts: "split"`): when every statement is one of the forms
  `proto/assert_split.py` lists (`assert f(1, 2) == 3`, `set(f(x)) == {...}`,
  `math.isclose(...)` after `import math`, HumanEval's `def check(candidate)` + `check(f)` or
  the spec's `entry_point`, ...), only the calls enter the sandbox (`call_harness.py`); their
  results come back as plain data and the asserts are evaluated here. The expected values
  never enter the sandbox, so nothing the program does in its own process (an always-true
  `__eq__`, a patched `math.isclose` or `builtins.sorted`, `sys.settrace`, a forged result
  line, an early exit) can turn a wrong answer into a pass.
* `assert_code`, in sandbox (details `asserts: "in_sandbox"` and `unsplittable`: the first
  line that prevents the split): any other form (setup statements, loops, helper calls...) runs
  as written, solution then asserts in one process; the run passes only if a random sentinel,
  handed to the harness on stdin and printed after the last assert, ends stdout. `sys.exit(0)`
  / `os._exit(0)` before the asserts therefore fail, but the program shares the asserts'
  process and can game them as above: these tests are not hack-resistant. A `strict` spec
  never gets here: its model refuses unsplittable asserts (422, at submission too).
`asyncrl_reward_code_assert_items_total{mode="split"|"in_sandbox"}` counts assert_code items
by the way they ran.

Per-test statuses: passed, failed, timeout, memory, runtime_error, output_limit, sandbox_error,
and skipped (not run: a non-partial item stops at its first failure, whose reward is 0
anyway). An `assert_code` item is one test: all its asserts in one run, passed if all pass.
A program that loops or runs out of memory is a wrong answer (`scored`, reward 0); only a
sandbox that failed to run the program makes the item `error`.
"""

from __future__ import annotations

import asyncio
import math
import re
import secrets
from pathlib import Path

from asyncrl.proto.records import RewardStatus
from asyncrl.proto.verifiers import CodeSpec, CodeTest, SpecError
from asyncrl.services.reward.metrics import CODE_ASSERT_ITEMS, CODE_TESTS, SANDBOX_FAILURES
from asyncrl.services.reward.sandbox import Limits, RunResult, Sandbox
from asyncrl.services.reward.verifiers import call_harness
from asyncrl.services.reward.verifiers.asserts import (
    BadResults,
    Check,
    Unsplittable,
    all_calls,
    calls_line,
    first_failure,
    read_results,
    split_asserts,
)
from asyncrl.services.reward.verifiers.base import Verdict, Verifier

FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
MAX_SOURCE_CHARS = 200_000
STDERR_TAIL_CHARS = 400
SPAWN_OVERHEAD_S = 1.0  # per test, on top of its timeout, in the item budget
MEMORY_MARKERS = (b"MemoryError", b"Cannot allocate memory", b"std::bad_alloc")
SIGXCPU_EXIT, SIGKILL_EXIT = 128 + 24, 128 + 9  # bwrap reports a signalled child as 128 + signal
PARSE_IN_THREAD_CHARS = 64 * 1024  # longer assert_code is parsed off the event loop
CALL_HARNESS = Path(call_harness.__file__).read_text()

ASSERT_HARNESS = """\
import sys


def _run():
    token = sys.stdin.readline().strip()
    sys.stdin = open("/dev/null")
    scope = {"__name__": "__main__"}
    with open("solution.py") as f:
        exec(compile(f.read(), "solution.py", "exec"), scope)
    with open("tests.py") as f:
        exec(compile(f.read(), "tests.py", "exec"), scope)
    sys.stdout.flush()
    sys.stdout.write("\\n" + token + "\\n")
    sys.stdout.flush()


_run()
"""


def extract_program(completion: str) -> str:
    """The last fenced code block (any language tag), else the whole completion."""
    blocks = FENCE.findall(completion)
    return blocks[-1][1] if blocks else completion


def normalise_output(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


class CodeVerifier(Verifier):
    name = "code"
    description = (
        "Runs the last fenced code block in a bubblewrap sandbox against stdin/stdout `tests` or "
        "`assert_code` (simple asserts are judged outside the sandbox, `details.asserts` says so); "
        "reward 1 if all pass (passed fraction when `partial`)."
    )
    Spec = CodeSpec

    def __init__(
        self,
        sandbox: Sandbox,
        *,
        concurrency: int,
        item_timeout_s: float,
        max_test_timeout_s: float,
        max_memory_mb: int,
        max_tests: int,
        output_bytes: int,
        tmpfs_mb: int,
        max_procs: int,
        max_files: int,
    ):
        super().__init__(concurrency=concurrency, timeout_s=item_timeout_s)
        self.sandbox = sandbox
        self.max_test_timeout_s = max_test_timeout_s
        self.max_memory_mb = max_memory_mb
        self.max_tests = max_tests
        self.output_bytes = output_bytes
        self.tmpfs_mb = tmpfs_mb
        self.max_procs = max_procs
        self.max_files = max_files

    def parse_spec(self, args: dict) -> CodeSpec:
        spec = super().parse_spec(args)
        if spec.timeout_s > self.max_test_timeout_s:
            raise SpecError(
                f"timeout_s: {spec.timeout_s:g} is above this server's limit {self.max_test_timeout_s:g}"
            )
        if spec.memory_mb > self.max_memory_mb:
            raise SpecError(f"memory_mb: {spec.memory_mb} is above this server's limit {self.max_memory_mb}")
        if spec.tests is not None and len(spec.tests) > self.max_tests:
            raise SpecError(f"tests: {len(spec.tests)} tests, this server runs at most {self.max_tests}")
        return spec

    def item_timeout_s(self, spec: CodeSpec) -> float:
        runs = len(spec.tests) if spec.tests is not None else 1
        return min(self.timeout_s, runs * (spec.timeout_s + SPAWN_OVERHEAD_S))

    def _limits(self, spec: CodeSpec) -> Limits:
        return Limits(
            wall_s=spec.timeout_s,
            cpu_s=max(1, math.ceil(spec.timeout_s)),
            memory_mb=spec.memory_mb,
            fsize_mb=self.tmpfs_mb,
            nofile=self.max_files,
            nproc=self.max_procs,
            output_bytes=self.output_bytes,
            tmpfs_mb=self.tmpfs_mb,
        )

    async def verify(self, spec: CodeSpec, prompt: str, completion: str) -> Verdict:
        program = extract_program(completion)
        if len(program) > MAX_SOURCE_CHARS:
            return Verdict.scored(0.0, tests=[], error=f"program longer than {MAX_SOURCE_CHARS} chars")
        limits = self._limits(spec)
        mode = {}
        if spec.assert_code is not None:
            result, mode = await self._assert_item(program, spec, limits)
            results = [result]
        else:
            results = []
            for test in spec.tests:
                if results and results[-1]["status"] != "passed" and not spec.partial:
                    results.append({"status": "skipped"})
                    continue
                results.append(await self._run_test(program, test, limits))
        for result in results:
            CODE_TESTS.labels(result["status"]).inc()
        broken = [r for r in results if r["status"] == "sandbox_error"]
        if broken:
            return Verdict.failed(
                RewardStatus.error, "sandbox_error", tests=results, error=broken[0].get("error"), **mode
            )
        passed = sum(r["status"] == "passed" for r in results)
        reward = passed / len(results) if spec.partial else float(passed == len(results))
        return Verdict.scored(reward, passed=passed, total=len(results), tests=results, **mode)

    async def _run_test(self, program: str, test: CodeTest, limits: Limits) -> dict:
        run = await self.sandbox.run({"main.py": program}, ["main.py"], test.stdin, limits)
        status = _classify(run)
        if status == "exited_ok":
            got = run.stdout.decode(errors="replace")
            status = "passed" if normalise_output(got) == normalise_output(test.stdout) else "failed"
        return _report(status, run)

    async def _assert_item(self, program: str, spec: CodeSpec, limits: Limits) -> tuple[dict, dict]:
        """The item's one test result, and its details on how the asserts ran."""
        source, entry_point = spec.assert_code, spec.entry_point
        try:
            if len(source) > PARSE_IN_THREAD_CHARS:
                checks = await asyncio.to_thread(split_asserts, source, entry_point)
            else:
                checks = split_asserts(source, entry_point)
        except Unsplittable as exc:
            CODE_ASSERT_ITEMS.labels("in_sandbox").inc()
            if entry_point is not None:
                source += f"\n\ncheck({entry_point})\n"
            result = await self._run_asserts(program, source, limits)
            return result, {"asserts": "in_sandbox", "unsplittable": str(exc)}
        CODE_ASSERT_ITEMS.labels("split").inc()
        return await self._run_split(program, checks, limits), {"asserts": "split"}

    async def _run_split(self, program: str, checks: list[Check], limits: Limits) -> dict:
        nonce = secrets.token_hex(16)
        files = {"main.py": CALL_HARNESS, "solution.py": program}
        run = await self.sandbox.run(files, ["main.py"], f"{nonce}\n{calls_line(checks)}\n", limits)
        status = _classify(run)
        if status != "exited_ok":
            return _report(status, run)
        try:
            failure = first_failure(checks, read_results(run.stdout, nonce, len(all_calls(checks))))
        except BadResults as exc:
            failure = str(exc)
        if failure is not None:
            return {**_report("failed", run), "error": failure}
        return {**_report("passed", run), "checked": len(checks)}

    async def _run_asserts(self, program: str, assert_code: str, limits: Limits) -> dict:
        token = secrets.token_hex(16)
        files = {"main.py": ASSERT_HARNESS, "solution.py": program, "tests.py": assert_code}
        run = await self.sandbox.run(files, ["main.py"], token + "\n", limits)
        status = _classify(run)
        if status == "runtime_error" and b"AssertionError" in run.stderr[-4096:]:
            status = "failed"
        elif status == "exited_ok":
            lines = run.stdout.decode(errors="replace").rstrip("\n").splitlines()
            status = "passed" if lines and lines[-1] == token else "failed"
            if status == "failed":
                return {
                    **_report(status, run),
                    "error": "sentinel missing: the program exited before the last assert",
                }
        return _report(status, run)


def _classify(run: RunResult) -> str:
    if run.outcome == "sandbox_error":
        SANDBOX_FAILURES.labels("start_failed").inc()
        return "sandbox_error"
    if run.outcome in ("timeout", "output_limit"):
        return run.outcome
    if any(marker in run.stderr[-4096:] for marker in MEMORY_MARKERS):
        return "memory"
    if run.exit_code in (SIGXCPU_EXIT, SIGKILL_EXIT):
        return "timeout"  # CPU-time limit: SIGXCPU, or (as the sandbox's pid 1) the hard limit's SIGKILL
    return "exited_ok" if run.exit_code == 0 else "runtime_error"


def _report(status: str, run: RunResult) -> dict:
    report = {"status": status, "time_s": round(run.duration_s, 3)}
    if run.exit_code is not None:
        report["exit_code"] = run.exit_code
    if status in ("runtime_error", "memory", "failed") and run.stderr:
        report["stderr_tail"] = run.stderr[-STDERR_TAIL_CHARS:].decode(errors="replace")
    if status == "sandbox_error":
        report["error"] = run.error
    return report

"""`python`: the policy's code runs in the bubblewrap sandbox (`services/reward/sandbox.py`).

Each call is a fresh interpreter in a fresh sandbox (no network, a private tmpfs, rlimits, a
wall clock; nothing survives the call), under the limits the app passes (`env_python_*` and
the code verifier's `code_*` settings). The observation is stdout (its first `output_chars`
characters), then stderr (its last ones, where a traceback ends), then a note in brackets when
something was cut, the program failed, or it was killed. Status: `ok` (exit 0), `tool_error`
(non-zero exit, output past the sandbox's cap), `timeout` (killed at the time or CPU limit).
A sandbox that cannot run the program at all, or no free sandbox slot within the queue budget,
is the environment's failure: the episode is masked (`failure_kind` `sandbox` or
`queue_timeout`), never scored. Tool-only: the final answer is scored by a verifier.
"""

from __future__ import annotations

import asyncio
import math

from asyncrl.proto.environments import StepRequest, StepResponse, StepStatus, ToolCall
from asyncrl.services.reward.environments.base import Environment, NoArgs, function, reply, text_argument
from asyncrl.services.reward.metrics import SANDBOX_FAILURES
from asyncrl.services.reward.sandbox import Limits, RunResult, Sandbox
from asyncrl.services.reward.verifiers.code import MAX_SOURCE_CHARS, SIGKILL_EXIT, SIGXCPU_EXIT

RUN_OVERHEAD_S = 3.0  # spawn, plus the pipes' drain after a kill (sandbox.PIPE_DRAIN_TIMEOUT_S)
ERROR_CHARS = 500  # of a sandbox failure's message, in `info`


class PythonEnvironment(Environment):
    name = "python"
    description = (
        "A Python 3 tool: each call runs its code in a fresh sandboxed interpreter (no network, no "
        "files kept between calls) and shows stdout and stderr; the final answer is scored by the job's verifier."
    )
    tools = [
        function(
            "python",
            "Run Python 3 code in a fresh sandboxed interpreter; you see what it prints (stdout, then stderr).",
            {"code": {"type": "string", "description": "the program; print the values you need"}},
        )
    ]
    Args = NoArgs

    def __init__(
        self,
        sandbox: Sandbox,
        *,
        timeout_s: float,
        memory_mb: int,
        output_chars: int,
        queue_timeout_s: float,
        output_bytes: int,
        tmpfs_mb: int,
        max_procs: int,
        max_files: int,
    ):
        self.sandbox = sandbox
        self.limits = Limits(
            wall_s=timeout_s,
            cpu_s=max(1, math.ceil(timeout_s)),
            memory_mb=memory_mb,
            fsize_mb=tmpfs_mb,
            nofile=max_files,
            nproc=max_procs,
            output_bytes=output_bytes,
            tmpfs_mb=tmpfs_mb,
        )
        self.output_chars = output_chars
        self.budget_s = queue_timeout_s + timeout_s + RUN_OVERHEAD_S

    async def call(self, args: NoArgs, req: StepRequest, call: ToolCall) -> StepResponse:
        code = text_argument(call, "code")
        if code is None:
            return reply('python takes {"code": "<program>"}', StepStatus.invalid_call)
        if len(code) > MAX_SOURCE_CHARS:
            return reply(f"the program is longer than {MAX_SOURCE_CHARS} characters", StepStatus.invalid_call)
        try:
            async with asyncio.timeout(self.budget_s):  # cancelling a run kills its sandbox
                run = await self.sandbox.run({"main.py": code}, ["main.py"], "", self.limits)
        except TimeoutError:
            return _masked("queue_timeout", f"no sandbox free within {self.budget_s:g} s")
        if run.outcome == "sandbox_error":
            SANDBOX_FAILURES.labels("start_failed").inc()
            return _masked("sandbox", run.error or "sandbox error")
        status, note = self._outcome(run)
        text = _lines(
            self._shown(run.stdout, "stdout", head=True), self._shown(run.stderr, "stderr", head=False), note
        )
        info = {"exit_code": run.exit_code, "time_s": round(run.duration_s, 3)}
        return reply(text or "[no output]", status, info=info)

    def _outcome(self, run: RunResult) -> tuple[StepStatus, str]:
        if run.outcome == "timeout" or run.exit_code in (SIGXCPU_EXIT, SIGKILL_EXIT):
            # the wall clock, or the CPU limit: SIGXCPU, or (as the sandbox's pid 1) the hard limit's SIGKILL
            return StepStatus.timeout, f"[killed: time limit of {self.limits.wall_s:g} s]"
        if run.outcome == "output_limit":
            return StepStatus.tool_error, f"[killed: output past {self.limits.output_bytes} bytes]"
        if run.exit_code != 0:
            return StepStatus.tool_error, f"[exit code {run.exit_code}]"
        return StepStatus.ok, ""

    def _shown(self, data: bytes, stream: str, *, head: bool) -> str:
        """The stream's text, its head (stdout) or tail (stderr) past `output_chars`, said so."""
        text = data.decode(errors="replace")
        if len(text) <= self.output_chars:
            return text
        n, total = self.output_chars, len(text)
        if head:
            return f"{text[:n]}\n[{stream} cut: the first {n} of {total} characters shown]\n"
        return f"[{stream} cut: the last {n} of {total} characters shown]\n{text[-n:]}"


def _lines(*parts: str) -> str:
    """The non-empty parts in order, each starting on a line of its own."""
    text = ""
    for part in filter(None, parts):
        text += ("" if not text or text.endswith("\n") else "\n") + part
    return text


def _masked(kind: str, error: str) -> StepResponse:
    return reply(
        "the code could not be run (the environment failed); this episode is not scored",
        StepStatus.tool_error,
        done=True,
        mask_sample=True,
        failure_kind=kind,
        info={"error": error[-ERROR_CHARS:]},
    )

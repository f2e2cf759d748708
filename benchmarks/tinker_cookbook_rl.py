"""An unmodified tinker-cookbook RL recipe trains against `asyncrl tinker` on the CPU (issue #35).

The recipe is tinker-cookbook 0.6.1's math RL example with its arithmetic environment
(`python -m tinker_cookbook.recipes.math_rl.train env=arithmetic`: additions of two numbers in
[0, 100] it generates itself, reward = correct - 0.1 * (1 - ended with the stop token)). It runs
in a venv of its own, as a user runs it, changed only through its own command-line config:
`base_url` (this stack's service), `model_name` (the local SmolLM2-135M-Instruct directory, also
the name the service is configured with), `renderer_name=qwen3_instruct` (ChatML: SmolLM2's
template less its default system line), tiny sizes, and `loss_fn=importance_sampling` (the
recipe's own default, `stable_reinforce`, needs sampler-side stability records this stack does
not keep). Per step it calls: `save_weights_for_sampler` without a name (a sampling session),
`group_size x groups_per_batch` concurrent `asample` calls of one sample each (stop token
`<|im_end|>`, temperature 1, logprobs), one `forward_backward` (importance_sampling on
target_tokens/logprobs/advantages, its per-datum `logprobs` read back) pipelined with one
`optim_step` (Adam 0.9/0.95/1e-8); at the end a named `save_weights` and
`save_weights_for_sampler`. Its `create_lora_training_client` sends the SDK's default
`train_unembed=True`, which the service accepts only with `unembed_without_adapter` (set here).

Stack, each part its own process on loopback: Redis (the service's command log), one reference
engine with LoRA (`asyncrl engine --enable-lora`), `asyncrl tinker`. The reward curve printed
is the recipe's own `metrics.jsonl` (`env/all/reward/total`, with its `correct` and `format`
parts); wall time covers the recipe process alone.

    .venv/bin/python benchmarks/tinker_cookbook_rl.py --steps 12
    .venv/bin/python benchmarks/tinker_cookbook_rl.py --base-url http://127.0.0.1:8004 --api-key tml-...
    .venv/bin/python benchmarks/tinker_cookbook_rl.py --venv-only   # build the venv, parse the config

The cookbook venv (`runs/venvs/cookbook`) is built on first use: torch==2.13.0 first (the CPU
wheel), then tinker==0.38.0, then tinker-cookbook==0.6.1 with `--no-deps` and its dependencies
listed here, because its `tml-renderers>=0.4.1` has no release on the index (0.2.1 is the
newest); that package is imported only by the Inkling / Kimi-K3 / tml_v0 renderers, never by
this recipe.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TORCH_PIN = "torch==2.13.0"
SDK_PIN = "tinker==0.38.0"
COOKBOOK_PIN = "tinker-cookbook==0.6.1"
# tinker-cookbook 0.6.1's Requires-Dist less tml-renderers (see the module docstring), plus its
# `math-rl` extra, which the math_rl recipe module imports at load time.
COOKBOOK_DEPS = [
    "aiohttp>=3.9.0",
    "anyio>=4.0.0",
    "blobfile>=3.0.0",
    "chz>=0.4.0",
    "cloudpickle>=3.0.0",
    "datasets>=2.14.0",
    "huggingface-hub>=0.20.0",
    "numpy>=1.24.0",
    "pillow>=10.0.0",
    "pydantic>=2.0.0",
    "pyrage>=1.4.0",
    "rich>=13.0.0",
    "safetensors>=0.4.0",
    "termcolor>=2.0.0",
    "tiktoken>=0.12.0",
    "tqdm>=4.60.0",
    "transformers!=5.3.0,!=5.4.*,!=5.5.0,!=5.5.1,!=5.5.2,!=5.5.3,!=5.6.*,>=4.57.6",
    "math-verify>=0.5.0",
    "pylatexenc>=2.0",
    "sympy>=1.12.0",
]
RECIPE_MODULE = "tinker_cookbook.recipes.math_rl.train"
RENDERER = "qwen3_instruct"  # <|im_start|>role\n…<|im_end|>, stop token <|im_end|>: SmolLM2's ChatML
START_TIMEOUT_S = 300.0  # engine and service load SmolLM2 and torch on a shared 2-core machine
STOP_GRACE_S = 15.0
# The recipe's reward parts, as its metrics.jsonl names them (rl/metric_util.py).
REWARD_KEYS = ("env/all/reward/total", "env/all/correct", "env/all/format")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12, help="the recipe's max_steps")
    p.add_argument("--group-size", type=int, default=8, help="samples per problem (the recipe's group_size)")
    p.add_argument("--groups-per-batch", type=int, default=8, help="problems per step")
    p.add_argument("--learning-rate", type=float, default=1e-3, help="LoRA Adam lr (cookbook's get_lr scale)")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument(
        "--max-tokens", type=int, default=5, help="the recipe's default: an answer and its stop token"
    )
    p.add_argument(
        "--save-every", type=int, default=0, help="recipe's periodic save_state+sampler (0: final only)"
    )
    p.add_argument("--model", type=Path, default=ROOT / "runs" / "models" / "smollm2")
    p.add_argument("--venv", type=Path, default=ROOT / "runs" / "venvs" / "cookbook")
    p.add_argument("--run-dir", type=Path, help="default: runs/tinker-cookbook-<time>")
    p.add_argument("--base-url", help="a service already running: start no stack, just run the recipe")
    p.add_argument("--api-key", help="with --base-url: the service's key (default $TINKER_API_KEY)")
    p.add_argument("--no-telemetry", action="store_true", help="TINKER_TELEMETRY=0 for the recipe")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="limit of the recipe process")
    p.add_argument("--json", type=Path, help="write the curve and figures here")
    p.add_argument("--venv-only", action="store_true", help="build the venv, check the recipe's config, exit")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# The cookbook's venv
# ---------------------------------------------------------------------------------------------


def cookbook_venv(venv: Path) -> Path:
    """The python of the cookbook venv, built (torch pinned first) unless already complete."""
    steps = [
        [TORCH_PIN],
        [SDK_PIN],
        ["--no-deps", COOKBOOK_PIN],
        COOKBOOK_DEPS,
    ]
    key = hashlib.sha256(json.dumps([sys.version, steps]).encode()).hexdigest()[:12]
    python, done = venv / "bin" / "python", venv / f".complete-{key}"
    if done.exists():
        return python
    print(f"building {venv} ({TORCH_PIN}, {SDK_PIN}, {COOKBOOK_PIN})", flush=True)
    start = time.monotonic()
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    for reqs in steps:
        pip = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", *reqs], capture_output=True, text=True
        )
        if pip.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            raise SystemExit(
                f"pip install {' '.join(reqs)} failed:\n{pip.stdout[-3000:]}\n{pip.stderr[-3000:]}"
            )
    size = subprocess.run(["du", "-sh", str(venv)], capture_output=True, text=True).stdout.split()[0]
    print(f"cookbook venv built in {time.monotonic() - start:.0f} s, {size}", flush=True)
    done.touch()
    return python


def check_recipe_config(python: Path, recipe_args: list[str]) -> None:
    """The recipe's own config class accepts this command line (chz refuses an unknown field or
    a bad value), checked without starting the recipe."""
    code = (
        "import sys, chz\n"
        f"from {RECIPE_MODULE} import CLIConfig\n"
        "print(chz.entrypoint(CLIConfig, argv=sys.argv[1:]))"
    )
    out = subprocess.run([str(python), "-c", code, *recipe_args], capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"the recipe refused its config:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def recipe_args(args, base_url: str, log_path: Path) -> list[str]:
    """The recipe's own config, `key=value` as chz reads it; nothing else about it changes."""
    return [
        f"base_url={base_url}",
        f"model_name={args.model.resolve()}",
        f"renderer_name={RENDERER}",
        "env=arithmetic",
        f"group_size={args.group_size}",
        f"groups_per_batch={args.groups_per_batch}",
        f"learning_rate={args.learning_rate}",
        f"lora_rank={args.lora_rank}",
        f"max_tokens={args.max_tokens}",
        "loss_fn=importance_sampling",
        f"max_steps={args.steps}",
        f"save_every={args.save_every}",
        "eval_every=0",
        f"log_path={log_path}",
        "behavior_if_log_dir_exists=delete",
    ]


# ---------------------------------------------------------------------------------------------
# The stack: Redis, one engine with LoRA, `asyncrl tinker`
# ---------------------------------------------------------------------------------------------


@dataclass
class Stack:
    base_url: str
    api_key: str
    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    redis: object | None = None  # asyncrl.buffer.server.RedisServer

    def stop(self) -> None:
        for name, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    print(f"{name} ignored SIGTERM for {STOP_GRACE_S:.0f} s: killed", flush=True)
                    proc.kill()
                    proc.wait()
        if self.redis is not None:
            self.redis.stop()


def wait_healthy(name: str, proc: subprocess.Popen, urls: list[str]) -> None:
    """Until one of `urls` answers 200; a process that exits first fails the run, named."""
    import httpx

    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited with {proc.returncode} before it was healthy (see its log)")
        for url in urls:
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
        time.sleep(0.5)
    raise SystemExit(f"{name} not healthy after {START_TIMEOUT_S:.0f} s at {urls}")


def spawn(name: str, cmd: list[str], env: dict[str, str], log_dir: Path) -> subprocess.Popen:
    log = open(log_dir / f"{name}.log", "w")  # noqa: SIM115 (the child writes it until it stops)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def start_stack(args, run_dir: Path) -> Stack:
    from asyncrl.buffer.server import RedisServer, free_port
    from asyncrl.services.ops.cli import SUBCOMMANDS
    from asyncrl.services.runtime.auth import ENGINE_TOKEN_ENV, generate_token

    if "tinker" not in SUBCOMMANDS:
        raise SystemExit(
            "`asyncrl tinker` does not exist in this checkout yet: run on a branch that has it, "
            "or point --base-url at a running service"
        )
    model = str(args.model.resolve())
    engine_token = generate_token()
    api_key = "tml-" + generate_token()  # the SDK's key prefix
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        ENGINE_TOKEN_ENV: engine_token,
    }
    weights_root = run_dir / "weights"
    weights_root.mkdir(parents=True)
    stack = Stack(base_url="", api_key=api_key)
    try:
        stack.redis = RedisServer(run_dir / "redis", fsync="everysec").start()
        engine_port, tinker_port = free_port(), free_port()
        engine_url = f"http://127.0.0.1:{engine_port}"
        engine = spawn(
            "engine",
            [sys.executable, "-m", "asyncrl.services.ops.cli", "engine", "--model", model,
             "--port", str(engine_port), "--weights-root", str(weights_root), "--num-threads", "1",
             "--enable-lora", "--max-lora-rank", str(args.lora_rank), "--lora-target-modules", "all",
             "--log-level", "warning"],
            env,
            run_dir,
        )  # fmt: skip
        stack.procs.append(("engine", engine))
        # base_models and engine_urls are a dict and a list: settings take those from the env
        # (JSON), the scalars from flags (services/runtime/config.py).
        tinker_env = {
            **env,
            "ASYNCRL_TINKER_BASE_MODELS": json.dumps({model: model}),
            "ASYNCRL_TINKER_ENGINE_URLS": json.dumps([engine_url]),
            "ASYNCRL_TINKER_API_TOKEN": api_key,
        }
        service = spawn(
            "tinker",
            [sys.executable, "-m", "asyncrl.services.ops.cli", "tinker", "--port", str(tinker_port),
             "--redis-url", stack.redis.url, "--weights-root", str(weights_root),
             "--checkpoints-root", str(run_dir / "checkpoints"), "--threads", "1",
             "--unembed-without-adapter"],
            tinker_env,
            run_dir,
        )  # fmt: skip
        stack.procs.append(("tinker", service))
        stack.base_url = f"http://127.0.0.1:{tinker_port}"
        wait_healthy("engine", engine, [f"{engine_url}/health"])
        wait_healthy("tinker", service, [f"{stack.base_url}/healthz", f"{stack.base_url}/api/v1/healthz"])
    except BaseException:
        stack.stop()
        raise
    return stack


# ---------------------------------------------------------------------------------------------
# The run and its curve
# ---------------------------------------------------------------------------------------------


def run_recipe(python: Path, cmd_args: list[str], api_key: str, run_dir: Path, args) -> tuple[int, float]:
    env = {
        **os.environ,
        "TINKER_API_KEY": api_key,
        # Nothing outside loopback is reachable: the tokenizer is the local directory's.
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    if args.no_telemetry:
        env["TINKER_TELEMETRY"] = "0"
    cmd = [str(python), "-m", RECIPE_MODULE, *cmd_args]
    print("recipe:", " ".join(cmd), flush=True)
    start = time.monotonic()
    with open(run_dir / "recipe.log", "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=run_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            for line in proc.stdout:
                log.write(line)
                if "Sampling batch" not in line:  # tqdm bars: in the log only
                    print("[recipe]", line.rstrip()[:300], flush=True)
                if time.monotonic() - start > args.timeout_s:
                    print(f"recipe past --timeout-s {args.timeout_s:.0f}: stopped", flush=True)
                    proc.send_signal(signal.SIGINT)
                    break
            rc = proc.wait(STOP_GRACE_S * 4)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    return rc, time.monotonic() - start


def read_curve(log_path: Path) -> list[dict]:
    """The recipe's training rows (one per step, those that carry the reward)."""
    path = log_path / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if REWARD_KEYS[0] in r]


def report(rows: list[dict], wall_s: float) -> dict:
    """The curve as a table, and whether the reward rose: the mean of the last third of the steps
    against the first third (the first step against the last with fewer than three)."""

    def f(row, key, spec="+.3f"):
        return format(row[key], spec) if key in row else "-"

    print(f"\n{'step':>4}  {'reward':>7}  {'correct':>7}  {'format':>7}  {'kl(s,t)':>9}  {'time s':>6}")
    for r in rows:
        print(
            f"{r.get('progress/batch', '?'):>4}  {f(r, REWARD_KEYS[0]):>7}  {f(r, REWARD_KEYS[1], '.3f'):>7}  "
            f"{f(r, REWARD_KEYS[2], '.3f'):>7}  {f(r, 'optim/kl_sample_train_v1', '+.1e'):>9}  "
            f"{f(r, 'time/total', '.1f'):>6}"
        )
    out: dict = {"steps": len(rows), "wall_s": round(wall_s, 1), "curve": rows}
    if rows:
        k = max(1, len(rows) // 3)
        first = sum(r[REWARD_KEYS[0]] for r in rows[:k]) / k
        last = sum(r[REWARD_KEYS[0]] for r in rows[-k:]) / k
        out |= {"reward_first": first, "reward_last": last, "rising": last > first}
        print(
            f"\nreward, mean of the first {k} step(s) {first:+.3f} -> last {k} {last:+.3f} "
            f"({'rising' if last > first else 'NOT rising'})"
        )
    print(f"{len(rows)} steps, recipe wall time {wall_s:.0f} s (its start-up and final save included)")
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if not (args.model / "config.json").exists():
        raise SystemExit(f"{args.model}: no HF model here (`make model-smollm2` writes runs/models/smollm2)")
    run_dir = (args.run_dir or ROOT / "runs" / time.strftime("tinker-cookbook-%Y%m%d-%H%M%S")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "recipe"
    python = cookbook_venv(args.venv)
    if args.venv_only:
        check_recipe_config(python, recipe_args(args, "http://127.0.0.1:1", log_path))
        print(f"{python}: {RECIPE_MODULE} accepts its config")
        return 0

    stack = None
    if args.base_url:
        base_url, api_key = args.base_url, args.api_key or os.environ.get("TINKER_API_KEY", "")
        if not api_key:
            raise SystemExit(
                "--base-url needs --api-key (or $TINKER_API_KEY): the SDK refuses to start without"
            )
    else:
        stack = start_stack(args, run_dir)
        base_url, api_key = stack.base_url, stack.api_key
    try:
        cmd_args = recipe_args(args, base_url, log_path)
        check_recipe_config(python, cmd_args)
        rc, wall_s = run_recipe(python, cmd_args, api_key, run_dir, args)
    finally:
        if stack is not None:
            stack.stop()
    summary = {"rc": rc, "command": cmd_args, **report(read_curve(log_path), wall_s)}
    print(f"recipe exit {rc}; logs in {run_dir}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

"""What `asyncrl demo` asks of the rollout service: its task's training prompts, posted as
rollout jobs, and the math task's held-out sets, named in the run config as the rollout service's
automatic evaluations. The tasks themselves are services/ops/tasks.py.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import httpx

from asyncrl.services.ops.run_config import DemoSection


def make_prompts(n: int, cfg: DemoSection, rng: random.Random) -> list[dict]:
    """`n` training prompts of the demo's task (services/ops/tasks.py)."""
    from asyncrl.services.ops.tasks import reverse_prompts

    if cfg.task == "math":
        return math_task(cfg).train_prompts(n, rng)
    if cfg.task == "secret":  # the word is the environment's (one per episode), not the prompt's
        return [{"text": "<bos>>"} for _ in range(n)]
    return reverse_prompts(n, cfg.letters, cfg.prompt_len, rng)


def episode(cfg: DemoSection) -> dict:
    """secret: each sample is an episode with the `secret` environment, whose one tool (`lookup`,
    called by sampling `?`) answers the episode's word; the answer is the word. Without the
    tool the word is a guess (expected reward 1/len(letters))."""
    if cfg.task != "secret":
        return {}
    return {
        "episode": {
            "environment": "secret",
            "max_turns": cfg.max_turns,
            "tool_format": "tagged",
            "tool_open": "?",
            "tool_close": "",
            "default_tool": "lookup",
            "observation_template": "{observation}",
            "tools": cfg.tools,
            "env_args": {"letters": cfg.letters, "length": cfg.prompt_len},
        }
    }


def math_task(cfg: DemoSection):
    from asyncrl.services.ops.tasks import HeldoutSet, MathTask

    return MathTask(
        eval_seed=cfg.eval_seed,
        eval_size=cfg.eval_size,
        word_fraction=cfg.word_fraction,
        level=cfg.level,
        more_heldout={name: HeldoutSet(**e.model_dump()) for name, e in cfg.eval_sets.items()},
        worked_example=cfg.worked_example,
    )


def sampling_params(cfg: DemoSection) -> dict:
    if cfg.task == "math":
        # EOS-terminated answers (the engine stops at any of the model's end-of-turn ids); the
        # reward reads the text without special tokens.
        return {"temperature": cfg.temperature, "max_new_tokens": cfg.max_new_tokens}
    # Fixed-length answers: every completion has exactly prompt_len tokens, so stopping
    # early is never an option the policy can collapse into (docs/architecture.md §10). Special
    # tokens stay in the text, so a sampled <eos> costs its position instead of vanishing
    # and sliding the later characters into place: the reward is exact per token.
    return {
        "temperature": 1.0,
        "max_new_tokens": cfg.prompt_len,
        "ignore_eos": True,
        "skip_special_tokens": False,
    }


EVAL_NAME = "heldout"


def heldout_sets(demo: DemoSection, run_dir: Path, raw: dict) -> dict[str, list[dict]]:
    """The math task's held-out sets, name -> prompts (the main one, `heldout`, first), each
    written to `<run_dir>/<name>.jsonl` and named in the run config `raw` as an automatic
    evaluation of the rollout service (`[rollout] eval_sets`, every `eval_every` versions)."""
    if demo.task != "math" or not demo.eval_every:
        return {}
    task = math_task(demo)
    heldout = {EVAL_NAME: task.heldout_prompts()} if demo.eval_size else {}
    heldout |= {name: held.prompts(name) for name, held in task.more_heldout.items()}
    for name, prompts in heldout.items():
        (run_dir / f"{name}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    if heldout:
        raw.setdefault("rollout", {}).update(
            eval_sets={name: str(run_dir / f"{name}.jsonl") for name in heldout},
            eval_every=demo.eval_every,
            eval_max_new_tokens=demo.max_new_tokens,
        )
    return heldout


PROMPTS_PER_JOB = 20_000  # well under the rollout service's per-job cap
TOPUP_STEPS = 250  # the demo submits prompts for this many steps at a time (twice over)


def submit(
    rollout_url: str, cfg: DemoSection, n_prompts: int, rng: random.Random, first_job: int = 0
) -> list[str]:
    """Post the reverse task in jobs of at most PROMPTS_PER_JOB prompts; returns the job ids.
    Job k gets the idempotency key demo-<seed>-<first_job + k>."""
    jobs = []
    for k, start in enumerate(range(0, n_prompts, PROMPTS_PER_JOB), start=first_job):
        body = {
            "prompts": make_prompts(min(PROMPTS_PER_JOB, n_prompts - start), cfg, rng),
            "group_size": cfg.group_size,
            "sampling_params": sampling_params(cfg),
            "idempotency_key": f"demo-{cfg.seed}-{k}",
            **episode(cfg),
        }
        resp = httpx.post(f"{rollout_url}/v1/rollouts", json=body, timeout=120)
        if resp.status_code != 202:
            raise RuntimeError(
                f"the rollout service refused the demo job ({resp.status_code}): {resp.text[:500]}"
            )
        jobs.append(resp.json()["job_id"])
    return jobs

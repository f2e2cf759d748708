"""Builders of valid records for tests (random but seeded)."""

from __future__ import annotations

import numpy as np
from msgspec.structs import replace

from asyncrl.proto import Group, GroupJob, RewardStatus, Sample


def make_sample(prompt_id="p0", index=0, n_tokens=5, version=0, reward=0.5, status=RewardStatus.scored, seed=0,
                versions=None) -> Sample:  # fmt: skip
    rng = np.random.default_rng(seed)
    return Sample(
        prompt_id=prompt_id,
        index=index,
        completion_ids=rng.integers(3, 40, n_tokens).astype(np.int32),
        behavior_logprobs=-rng.random(n_tokens).astype(np.float32),
        versions=np.asarray(versions if versions is not None else [version] * n_tokens, dtype=np.int32),
        finish_reason="length",
        reward=reward if status is RewardStatus.scored else None,
        reward_status=status,
    )


def make_group(group_id="g0", job_id="j0", n=4, n_tokens=5, version=0, submit_version=None, seed=0) -> Group:
    samples = [
        make_sample(group_id, i, n_tokens, version, reward=float(i) / n, seed=seed * 1000 + i)
        for i in range(n)
    ]
    return Group.build(
        group_id=group_id,
        job_id=job_id,
        prompt_tokens=np.array([1, 5, 6, 7], dtype=np.int32),
        reward_spec={"verifier": "reverse", "target": "dcb"},
        samples=samples,
        submit_version=version if submit_version is None else submit_version,
    )


def make_job(group_id="g0", job_id="j0", group_size=4) -> GroupJob:
    return GroupJob(
        job_id=job_id,
        group_id=group_id,
        prompt_id=group_id,
        prompt_tokens=np.array([1, 5, 6, 7], dtype=np.int32),
        prompt_text="bcd>",
        group_size=group_size,
        sampling_params={"temperature": 1.0, "max_new_tokens": 4},
        reward_spec={"verifier": "reverse", "target": "dcb"},
    )


def edit_sample(group: Group, index: int, **changes) -> Group:
    """`group` with sample `index` changed (records are frozen: build anew)."""
    samples = list(group.samples)
    samples[index] = replace(samples[index], **changes)
    return Group.build(group_id=group.group_id, job_id=group.job_id, prompt_tokens=group.prompt_tokens,
                       reward_spec=group.reward_spec, samples=samples, submit_version=group.submit_version)  # fmt: skip

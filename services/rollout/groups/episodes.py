"""Episodes: a group's samples as multi-turn, tool-using episodes with an environment
(docs/architecture.md §12).

    reset the environment → [its first observation (the task), loss mask 0: after a chat
        prompt a user message of the chat template, then the assistant header]
    for each turn (at most `max_turns`, the whole episode within `max_episode_tokens`):
        generate until EOS, the turn's max_new_tokens or a one-token call marker
            (tokens kept exactly as sampled, each with its behaviour logprob and policy
            version; a weight update mid-turn aborts → the prefix is resubmitted, as in
            one-turn partial rollouts)
        a tool call in the turn's text → environment step → its observation appended as
            tokens with loss mask 0 (a call that does not parse: an `invalid_call`
            observation, no step); no tool call → the final answer (a judging environment
            steps it and gives the reward) → done

The G episodes of a group run concurrently (their generate calls coalesce into batches). An
environment failure (`EnvironmentFailed`: unreachable after retries, refused, garbage,
`mask_sample`) starts the episode again, at most `retries` times, each counted by kind; then
the group fails whole (`EpisodeFailed`), counted; a failure the environment explains (an
OpenEnv server's error message) fails the group at once. The environment keeps nothing: a
rollout replica that dies restarts its groups' episodes whole when another recovers the job.

OpenEnv servers (`kind = "openenv"`, `_openenv_episode`) keep the episode's state in one
session instead: the same loop, the action from the call (`groups/openenv.py`), a dropped
session restarting the episode from reset.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from typing import TYPE_CHECKING

from asyncrl.proto import GroupJob
from asyncrl.proto.environments import Action, ResetRequest, StepRequest, StepStatus
from asyncrl.proto.rollout import EpisodeSpec
from asyncrl.services.rollout import metrics as m
from asyncrl.services.rollout.clients.environments import EnvironmentFailed
from asyncrl.services.rollout.clients.openenv import ActionRefused
from asyncrl.services.rollout.groups.openenv import ActionTool, observation_text
from asyncrl.services.rollout.segments import Draft
from asyncrl.services.rollout.toolcalls import (
    BadToolCall,
    ToolFormat,
    observation_ids,
    parse_tool_call,
    user_turn_ids,
)

if TYPE_CHECKING:
    from asyncrl.services.rollout.clients.environments import EnvClient
    from asyncrl.services.rollout.clients.openenv import OpenEnvClient
    from asyncrl.services.rollout.groups.sampler import GroupSampler


RESTART_DELAY_S = 0.5  # before an episode's first restart; doubles with each one
MAX_RESTART_DELAY_S = 5.0


class EpisodeFailed(ValueError):
    """An episode's environment kept failing: its group fails."""


def turn_stop_ids(tokenizer, fmt: ToolFormat) -> list[int]:
    """Tokens that end a turn besides EOS: the call's closing marker (its opening one when the
    call has no closing marker) when it is a single token."""
    marker = fmt.close or fmt.open
    ids = tokenizer(marker, add_special_tokens=False)["input_ids"] if marker else []
    return list(ids) if len(ids) == 1 else []


class EpisodeRunner:
    """Runs a group's episodes: the environment through `envs`, each policy turn through the
    group's `GroupSampler` (the scheduler's generate path, on the group's engine)."""

    def __init__(
        self,
        envs: EnvClient | None,
        tokenizer,
        *,
        context_length: int,
        default_max_new_tokens: int,
        initial_weight_version: int,
        openenv: OpenEnvClient | None = None,
    ):
        self.envs, self.tokenizer, self.openenv = envs, tokenizer, openenv
        self.context_length = context_length
        self.default_max_new_tokens = default_max_new_tokens
        self.initial_weight_version = initial_weight_version

    async def run(self, job: GroupJob, sampler: GroupSampler) -> list[Draft]:
        """The group's `group_size` episodes, concurrently; `EpisodeFailed` when one keeps failing."""
        spec = EpisodeSpec.model_validate(job.episode)
        fmt = ToolFormat.of(spec)
        stops = turn_stop_ids(self.tokenizer, fmt) if spec.tools else []
        if spec.kind == "openenv":
            if self.openenv is None or spec.environment not in self.openenv.servers:
                raise EpisodeFailed(f"OpenEnv server {spec.environment!r} is not configured here")
            server = self.openenv.servers[spec.environment]
            tool = ActionTool.of(
                spec.environment, await self.openenv.schema(spec.environment), server.description
            )

            def episode(d: Draft, attempt: int):
                return self._openenv_episode(job, sampler, spec, fmt, stops, tool, d, attempt)
        else:
            info = (await self.envs.environments()).environments.get(spec.environment)
            if info is None:
                raise EnvironmentFailed(
                    "unavailable", f"environment {spec.environment!r} is no longer served"
                )

            def episode(d: Draft, attempt: int):
                return self._episode(job, sampler, spec, fmt, stops, info.judges, d, attempt)

        tasks = [asyncio.ensure_future(self._with_retries(spec, episode, i)) for i in range(job.group_size)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:  # one episode failing its group (or a cancel) ends the others
            for t in tasks:
                t.cancel()

    async def _with_retries(self, spec: EpisodeSpec, episode, index: int) -> Draft:
        """`episode(draft, attempt)` until it completes, at most `retries` + 1 times."""
        last: EnvironmentFailed | None = None
        for attempt in range(spec.retries + 1):
            d = Draft(index, submitted=time.time(), loss_mask=[])
            try:
                await episode(d, attempt)
                return d
            except EnvironmentFailed as exc:
                m.EPISODES.labels("failed").inc()
                if not exc.retry:
                    raise EpisodeFailed(f"episode {index}: {exc}") from None
                m.EPISODE_RETRIES.labels(exc.kind).inc()
                last = exc
                if attempt < spec.retries:  # (a server that crashed gets a moment to come back)
                    await asyncio.sleep(min(RESTART_DELAY_S * 2**attempt, MAX_RESTART_DELAY_S))
        raise EpisodeFailed(
            f"episode {index}: environment {spec.environment!r} failed {spec.retries + 1} times; last: {last}"
        )

    async def _turn(
        self,
        sampler: GroupSampler,
        prompt: list[int],
        d: Draft,
        budget: int,
        params: dict,
        turn: int,
        stop_ids: list[int],
    ) -> str:
        """One policy turn: up to `budget` tokens appended to `d` (loss mask 1), resubmitting
        prompt + tokens so far after a weight-update abort; its finish reason."""
        base = dict(params)
        if stop_ids:
            base["stop_token_ids"] = sorted({*params.get("stop_token_ids", ()), *stop_ids})
        await sampler.generate([prompt], [d], [len(d.tokens) + budget], base, first_segment=1000 * turn)
        return d.finish_reason

    async def _episode(
        self,
        job: GroupJob,
        sampler: GroupSampler,
        spec: EpisodeSpec,
        fmt: ToolFormat,
        stops: list[int],
        judges: bool,
        d: Draft,
        attempt: int,
    ) -> None:
        env, envs, tok = spec.environment, self.envs, self.tokenizer
        params = dict(job.sampling_params)
        turn_budget = int(params.get("max_new_tokens", self.default_max_new_tokens))
        prompt = job.prompt_tokens.tolist()
        room = self.context_length - len(prompt)
        if spec.max_episode_tokens is not None:
            room = min(room, spec.max_episode_tokens)
        episode_id = f"{job.group_id}/{d.index}"
        # One task per sample, the same after a restart (a crash, an environment retry): its
        # reward does not depend on which replica ran it.
        seed = zlib.crc32(episode_id.encode()) + params.get("sampling_seed", 0) % 2**31
        reset = await envs.reset(
            env, ResetRequest(episode_id=episode_id, seed=seed, prompt=job.prompt_text, args=spec.env_args)
        )
        state = reset.state

        def step(turn: int, action: Action):  # the environment's step, in the episode's current state
            request = StepRequest(
                episode_id=episode_id, seed=seed, turn=turn, args=spec.env_args, state=state, action=action
            )
            return envs.step(env, request)

        _observe(d, task_ids(tok, job, reset.observation), self.initial_weight_version)
        eos = {tok.eos_token_id}
        finish, answer = "length", ""
        for turn in range(spec.max_turns):
            left = room - len(d.tokens)
            if left <= 0:
                break
            start = len(d.tokens)
            d.turn_starts.append(start)
            finish = await self._turn(sampler, prompt, d, min(turn_budget, left), params, turn, stops)
            text = tok.decode(d.tokens[start:], skip_special_tokens=params.get("skip_special_tokens", True))
            try:
                call = parse_tool_call(text, fmt) if spec.tools else None
                problem = None
            except BadToolCall as exc:
                call, problem = None, str(exc)
            if call is None and problem is None:  # the final answer
                answer = _answer(tok, d.tokens[start:], finish, params)
                reward = 0.0  # (an environment that does not judge: a verifier scores the answer)
                if judges:
                    out = await step(turn, Action(text=answer))
                    reward = out.reward or 0.0
                d.turn_rewards.append(reward)
                break
            if turn == spec.max_turns - 1:  # a call on the last turn: nothing may answer it
                finish = "length"
                d.turn_rewards.append(0.0)
                break
            if problem is not None:
                m.TOOL_CALLS.labels("unparsable").inc()
                m.ENV_STEPS.labels(env, StepStatus.invalid_call.value).inc()
                observation, reward = f"[invalid_call] {problem}", 0.0
            else:
                m.TOOL_CALLS.labels("called").inc()
                out = await step(turn, Action(tool_call=call))
                state, reward = out.state, out.reward or 0.0
                observation = (
                    out.observation
                    if out.status is StepStatus.ok
                    else f"[{out.status.value}] {out.observation}"
                )
                if out.done:
                    d.turn_rewards.append(reward)
                    break
            d.turn_rewards.append(reward)
            after_eos = bool(d.tokens) and d.tokens[-1] in eos
            _observe(
                d,
                observation_ids(tok, fmt, observation, after_eos)[: max(room - len(d.tokens), 0)],
                d.versions[-1] if d.versions else self.initial_weight_version,
            )
        d.finish_reason, d.text = finish, answer
        d.finished = time.time()
        if judges:
            d.env_reward = sum(d.turn_rewards)
        d.details = {"environment": env, "turns": len(d.turn_starts), "attempt": attempt}
        m.EPISODES.labels("answered" if answer else finish).inc()

    async def _openenv_episode(
        self,
        job: GroupJob,
        sampler: GroupSampler,
        spec: EpisodeSpec,
        fmt: ToolFormat,
        stops: list[int],
        tool: ActionTool,
        d: Draft,
        attempt: int,
    ) -> None:
        """One episode with an OpenEnv server, in one session: reset → (policy turn → the action
        its call makes → step) until a turn calls nothing, the server says `done`, or turns or
        tokens run out. The reward is the sum of the steps' rewards when the server `judges`
        (configured), else the job's verifier's on the final answer."""
        env, tok = spec.environment, self.tokenizer
        params = dict(job.sampling_params)
        turn_budget = int(params.get("max_new_tokens", self.default_max_new_tokens))
        prompt = job.prompt_tokens.tolist()
        room = self.context_length - len(prompt)
        if spec.max_episode_tokens is not None:
            room = min(room, spec.max_episode_tokens)
        episode_id = f"{job.group_id}/{d.index}"
        seed = zlib.crc32(episode_id.encode()) + params.get("sampling_seed", 0) % 2**31
        finish, answer, actions = "length", "", []
        async with self.openenv.session(env) as session:
            reset = await session.reset({**spec.env_args, "seed": seed, "episode_id": episode_id})
            # (a task longer than the room is cut, and the episode gets no turn)
            task = task_ids(tok, job, observation_text(reset.observation))
            _observe(d, task[:room], self.initial_weight_version)
            for turn in range(spec.max_turns):
                left = room - len(d.tokens)
                if left <= 0:
                    break
                start = len(d.tokens)
                d.turn_starts.append(start)
                finish = await self._turn(sampler, prompt, d, min(turn_budget, left), params, turn, stops)
                text = tok.decode(
                    d.tokens[start:], skip_special_tokens=params.get("skip_special_tokens", True)
                )
                try:
                    action, problem = (tool.action(text, fmt) if spec.tools else None), None
                except BadToolCall as exc:
                    action, problem = None, str(exc)
                if action is None and problem is None:  # the final answer
                    answer = _answer(tok, d.tokens[start:], finish, params)
                    d.turn_rewards.append(0.0)
                    break
                if turn == spec.max_turns - 1:  # a call on the last turn: nothing may answer it
                    finish = "length"
                    d.turn_rewards.append(0.0)
                    break
                reward = 0.0
                if problem is None:
                    m.TOOL_CALLS.labels("called").inc()
                    actions.append(action)
                    try:
                        out = await session.step(action)
                    except ActionRefused as exc:
                        problem = str(exc)
                    else:
                        m.ENV_STEPS.labels(env, StepStatus.ok.value).inc()
                        observation = observation_text(out.observation)
                        reward = float(out.reward or 0.0)
                        if out.done:
                            d.turn_rewards.append(reward)
                            break
                else:
                    m.TOOL_CALLS.labels("unparsable").inc()
                if problem is not None:
                    m.ENV_STEPS.labels(env, StepStatus.invalid_call.value).inc()
                    observation = f"[invalid_call] {problem}"
                d.turn_rewards.append(reward)
                after_eos = bool(d.tokens) and d.tokens[-1] == tok.eos_token_id
                _observe(
                    d,
                    observation_ids(tok, fmt, observation, after_eos)[: max(room - len(d.tokens), 0)],
                    d.versions[-1] if d.versions else self.initial_weight_version,
                )
        d.finish_reason, d.text = finish, answer
        d.finished = time.time()
        if self.openenv.servers[env].judges:
            d.env_reward = sum(d.turn_rewards)
        d.details = {"environment": env, "turns": len(d.turn_starts), "attempt": attempt, "actions": actions}
        m.EPISODES.labels("answered" if answer else finish).inc()


def task_ids(tok, job: GroupJob, observation: str) -> list[int]:
    """The environment's first observation as tokens after the prompt: a user message of the chat
    template (and the assistant header) after a chat prompt, the bare text after any other."""
    if job.chat:
        return user_turn_ids(tok, observation)
    return list(tok(observation, add_special_tokens=False)["input_ids"]) if observation else []


def _observe(d: Draft, ids: list[int], version: int) -> None:
    """Tokens the policy did not sample: loss mask 0, logprob 0, the version before them."""
    d.tokens += ids
    d.logprobs += [0.0] * len(ids)
    d.versions += [version] * len(ids)
    d.loss_mask += [0] * len(ids)


def _answer(tok, ids: list[int], finish: str, params: dict) -> str:
    """The final turn's text as SGLang gives it (a matched stop token trimmed)."""
    if finish == "stop" and not params.get("no_stop_trim"):
        ids = ids[:-1]
    return tok.decode(ids, skip_special_tokens=params.get("skip_special_tokens", True))

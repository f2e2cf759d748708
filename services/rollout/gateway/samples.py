"""How a gateway session's calls become a group's samples (services/rollout/gateway/chat.py serves
the calls and puts the group).

A session whose calls extend each other exactly (each prompt = the previous prompt + completion
+ new tokens) is one sample, a `Piece`: the new tokens (template glue, tool results, user turns)
have loss mask 0, behaviour logprob 0 and the version of the policy token before them, and
`turn_starts` marks where each call's completion begins. A call whose prompt is not such an
extension starts a new piece with its own `prompt_ids`; the later pieces name the first in
`episode`, and all carry the session's reward.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from asyncrl.buffer import ClosedSession
from asyncrl.proto import FinishReason, Group, RewardStatus, Sample, Timings
from asyncrl.proto.gateway import Call
from asyncrl.proto.lineage import merge

GATEWAY_JOB_ID = "gateway"  # the job id of every gateway group (the buffer counts their exits under it)


@dataclass
class Piece:
    """A stretch of a session's calls that extend each other: one sample."""

    prompt: list[int]
    completion: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # 1: sampled by the policy
    turn_starts: list[int] = field(default_factory=list)
    finish_reason: FinishReason = FinishReason.stop  # of its last call
    text: str = ""  # its last call's reply
    started: float = 0.0
    finished: float = 0.0

    def add(
        self, call: Call, prompt: list[int], tokens: list[int], logprobs: list[float], versions: list[int]
    ) -> None:
        """Append a call whose prompt extends this piece: the new prompt tokens as the
        environment's (mask 0, logprob 0, the version of the policy token before them), then
        the completion as the policy's."""
        glue = prompt[len(self.prompt) + len(self.completion) :]
        before = self.versions[-1] if self.versions else (versions[0] if versions else 0)
        self.completion += glue
        self.logprobs += [0.0] * len(glue)
        self.versions += [before] * len(glue)
        self.mask += [0] * len(glue)
        if tokens:  # (a turn with no token has no start inside the completion)
            self.turn_starts.append(len(self.completion))
        self.completion += tokens
        self.logprobs += logprobs
        self.versions += versions
        self.mask += [1] * len(tokens)
        self.finish_reason, self.text, self.finished = call.finish_reason, call.text, call.finished

    def extended_by(self, prompt: list[int]) -> bool:
        n = len(self.prompt)
        return prompt[:n] == self.prompt and prompt[n : n + len(self.completion)] == self.completion


def sessions_to_pieces(calls: list[Call]) -> list[Piece]:
    """One session's calls (in order) as the pieces of its episode: a call whose prompt extends
    the current piece's prompt + completion joins it, any other starts a new piece."""
    pieces: list[Piece] = []
    for call in calls:
        prompt, tokens, logprobs, versions = call.arrays()
        if not pieces or not pieces[-1].extended_by(prompt):
            pieces.append(Piece(prompt=prompt, started=call.started))
        pieces[-1].add(call, prompt, tokens, logprobs, versions)
    return pieces


def build_group(group_id: str, meta: dict[str, str], sessions: list[ClosedSession]) -> tuple[Group, int]:
    """The group of closed sessions (ordered by their index) and how many of them split. The
    group's prompt is the first piece of the first session; a piece with another prompt
    carries it in `prompt_ids`; a split session's pieces name its first in `episode`. A
    sample's text and finish reason are its last call's (the reply its reward judged)."""
    samples: list[Sample] = []
    prompt_tokens: list[int] | None = None
    splits = 0
    for session in sorted(sessions, key=lambda s: s.index):
        pieces = sessions_to_pieces(session.calls)
        if prompt_tokens is None:
            prompt_tokens = pieces[0].prompt
        first = len(samples)
        splits += len(pieces) > 1
        reward, status = session.result.get("reward"), RewardStatus(session.result["status"])
        for piece in pieces:
            samples.append(
                Sample(
                    prompt_id=meta["prompt_id"],
                    index=len(samples),
                    completion_ids=piece.completion,
                    behavior_logprobs=piece.logprobs,
                    versions=piece.versions,
                    finish_reason=piece.finish_reason,
                    truncated=piece.finish_reason is FinishReason.length,
                    text=piece.text,
                    reward=reward,
                    reward_status=status,
                    reward_details=session.result.get("details") or {},
                    timings=Timings(
                        submitted=piece.started, finished=piece.finished, scored=session.closed_at
                    ),
                    loss_mask=piece.mask,
                    turn_starts=piece.turn_starts,
                    prompt_ids=piece.prompt if piece.prompt != prompt_tokens else [],
                    episode=first if len(pieces) > 1 else None,
                )
            )
    lineage: dict[int, int] = {}
    for session in sessions:
        for call in session.calls:
            merge(lineage, call.lineage)
    group = Group.build(
        group_id=group_id,
        job_id=GATEWAY_JOB_ID,
        prompt_tokens=prompt_tokens,
        reward_spec=json.loads(meta.get("spec") or "{}"),
        samples=samples,
        submit_version=int(meta["submit_version"]),
        lineage=lineage,
    )
    return group, splits

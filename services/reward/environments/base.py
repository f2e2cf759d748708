"""The environment interface: tools, task arguments, `reset` and `step`, no memory between calls.

An `Environment` answers one call from the request alone: what an episode must remember goes
in `state` (none of the environments here needs any). `step` reads the action: a `text` is the
final answer (`answer`: done; reward None unless the environment `judges`), a tool call goes to
`call` when it names one of `tools`, else it is `invalid_call`. Task arguments (`args`) are
checked against `Args` on every call, as a verifier's spec is (`SpecError` → HTTP 422).
Observations are cut to MAX_OBSERVATION_CHARS and made encodable here (`wire_text`), so a
reply can always be written out.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from asyncrl.proto.environments import (
    MAX_OBSERVATION_CHARS,
    EnvironmentInfo,
    ResetRequest,
    ResetResponse,
    StepRequest,
    StepResponse,
    StepStatus,
    ToolCall,
)
from asyncrl.proto.verifiers import validate_spec


class NoArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")


def function(name: str, description: str, properties: dict[str, Any] | None = None) -> dict[str, Any]:
    """An OpenAI function schema; every property listed is required."""
    parameters = {"type": "object", "properties": properties or {}, "required": list(properties or {})}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


def wire_text(text: str) -> str:
    """`text` as the policy may see it: cut to fit the wire, lone surrogates (from JSON escapes)
    written as escapes, since UTF-8 cannot carry them."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= MAX_OBSERVATION_CHARS else text[: MAX_OBSERVATION_CHARS - 20] + "\n[cut]"


def reply(text: str = "", status: StepStatus = StepStatus.ok, **fields: Any) -> StepResponse:
    return StepResponse(observation=wire_text(text), status=status, **fields)


def text_argument(call: ToolCall, key: str) -> str | None:
    """The tool's one string argument: `{key: "..."}` or the raw argument text; None if neither,
    or if the text cannot be encoded (a lone surrogate)."""
    args = call.arguments
    value = args if isinstance(args, str) else args.get(key) if set(args) == {key} else None
    if not isinstance(value, str):
        return None
    try:
        value.encode()
    except UnicodeEncodeError:
        return None
    return value


class Environment(abc.ABC):
    name: ClassVar[str]
    description: ClassVar[str]
    tools: ClassVar[list[dict[str, Any]]]  # OpenAI function schemas
    judges: ClassVar[bool] = False  # its final step carries the episode's reward
    Args: ClassVar[type[BaseModel]] = NoArgs  # task arguments (`args`), extra="forbid"

    def info(self) -> EnvironmentInfo:
        return EnvironmentInfo(description=self.description, tools=self.tools, judges=self.judges)

    def parse_args(self, args: dict[str, Any]) -> BaseModel:
        return validate_spec(self.Args, args)

    async def reset(self, req: ResetRequest) -> ResetResponse:
        self.parse_args(req.args)
        return ResetResponse(tools=self.tools)

    async def step(self, req: StepRequest) -> StepResponse:
        args = self.parse_args(req.args)
        if req.action.text is not None:
            return await self.answer(args, req, req.action.text)
        call = req.action.tool_call
        names = [tool["function"]["name"] for tool in self.tools]
        if call.name not in names:
            message = f"there is no tool {call.name[:64]!r}; the tools are: {', '.join(names)}"
            return reply(message, StepStatus.invalid_call, reward=0.0 if self.judges else None)
        return await self.call(args, req, call)

    async def answer(self, args: BaseModel, req: StepRequest, text: str) -> StepResponse:
        """The final answer ends the episode; a verifier scores it unless the environment judges."""
        return StepResponse(done=True)

    @abc.abstractmethod
    async def call(self, args: BaseModel, req: StepRequest, call: ToolCall) -> StepResponse:
        """Run one of `tools`; a failed tool is an observation, a failed environment is masked."""

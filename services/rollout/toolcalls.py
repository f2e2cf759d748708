"""Tool calls in the policy's text, and the environment's answers as tokens (docs/architecture.md §12).

Two formats (`proto.rollout.EpisodeSpec.tool_format`):

* `hermes`: `<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>`,
  the format of Qwen2.5/Qwen3, Hermes and most open chat templates. Answers enter the context
  as a `tool` message rendered by the model's own chat template.
* `tagged`: `{open}NAME ARGS{close}` with markers of the user's choosing, for models too small
  to write JSON (the CPU demo's character model calls its one tool with a single `?`). Answers
  enter as a template string with `{observation}` filled in.

Only text is parsed here; tokens are never re-tokenised from text: what the policy sampled
stays as sampled, and only the environment's part is tokenised (`observation_ids`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

from asyncrl.proto.environments import ToolCall
from asyncrl.proto.rollout import EpisodeSpec

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
TAGGED_OPEN, TAGGED_CLOSE = "<tool>", "</tool>"
_SENTINEL = "\x1f asyncrl assistant turn \x1f"  # content no chat template alters


@dataclass(frozen=True)
class ToolFormat:
    kind: str  # hermes | tagged
    open: str
    close: str  # "" (tagged): the call runs to the end of the turn
    default_tool: str = ""
    observation: str = "{observation}"

    @classmethod
    def of(cls, spec: EpisodeSpec) -> ToolFormat:
        if spec.tool_format == "hermes":
            return cls(
                "hermes",
                spec.tool_open or HERMES_OPEN,
                HERMES_CLOSE if spec.tool_close is None else spec.tool_close,
            )
        return cls(
            "tagged",
            spec.tool_open or TAGGED_OPEN,
            TAGGED_CLOSE if spec.tool_close is None else spec.tool_close,
            spec.default_tool,
            spec.observation_template,
        )


class BadToolCall(ValueError):
    """The turn opened a tool call that cannot be read: the policy is told so (`invalid_call`)."""


def parse_tool_call(text: str, fmt: ToolFormat) -> ToolCall | None:
    """The tool call the turn ends with (its last one), None for a final answer; `BadToolCall`
    for a call that does not parse."""
    body = call_body(text, fmt)
    if body is None:
        return None
    if fmt.kind == "hermes":
        try:
            call = json.loads(body)
        except json.JSONDecodeError as exc:
            raise BadToolCall(f"tool call is not JSON: {exc.msg}") from None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            raise BadToolCall('a tool call is {"name": ..., "arguments": {...}}')
        args = call.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, (dict, str)):
            raise BadToolCall("tool call arguments must be an object")
        return ToolCall(name=call["name"][:128], arguments=args)
    name, _, args = body.partition(" ")
    name = name or fmt.default_tool
    if not name:
        raise BadToolCall("tool call names no tool")
    return ToolCall(name=name[:128], arguments=args.strip())


def call_body(text: str, fmt: ToolFormat) -> str | None:
    """The text of the turn's last tool call between its markers (stripped), None when the turn
    opens none; `BadToolCall` for one left open."""
    start = text.rfind(fmt.open)
    if start < 0:
        return None
    body = text[start + len(fmt.open) :]
    if fmt.close:
        end = body.find(fmt.close)
        if end < 0:
            raise BadToolCall(f"tool call not closed with {fmt.close}")
        body = body[:end]
    return body.strip()


def user_turn_ids(tokenizer, observation: str) -> list[int]:
    """The tokens that follow a chat prompt rendered without its generation prompt: the
    environment's first observation (the task) as a `user` message of the model's chat template,
    then the assistant header the policy's first turn starts after; only the header when
    `observation` is empty. Prompt + these tokens read exactly as the template renders the
    conversation with the observation appended as a user message."""
    message, header = _user_glue(tokenizer.chat_template, tokenizer)
    text = message.replace(_SENTINEL, observation) if observation else header
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@lru_cache(maxsize=8)
def _user_glue(template: str | None, tokenizer) -> tuple[str, str]:
    """(the text of a `user` message with the sentinel as content plus the assistant header,
    the assistant header alone), each as it follows a user message."""
    if not template:
        raise BadToolCall("the model's tokenizer has no chat template for the task message")
    base = [{"role": "user", "content": _SENTINEL + "U"}]
    text = tokenizer.apply_chat_template(base, tokenize=False)
    full = tokenizer.apply_chat_template(
        base + [{"role": "user", "content": _SENTINEL}], tokenize=False, add_generation_prompt=True
    )
    opened = tokenizer.apply_chat_template(base, tokenize=False, add_generation_prompt=True)
    if not full.startswith(text) or not opened.startswith(text):
        raise BadToolCall("the chat template rewrites earlier turns when a user message follows")
    return full[len(text) :], opened[len(text) :]


def observation_ids(tokenizer, fmt: ToolFormat, observation: str, after_eos: bool) -> list[int]:
    """The tokens that put the environment's answer in the context after the policy's turn,
    up to where the policy's next turn starts. `after_eos`: the turn ended with the model's
    end-of-turn token (a chat template's end of an assistant message is then already there)."""
    if fmt.kind == "tagged":
        return list(
            tokenizer(fmt.observation.format(observation=observation), add_special_tokens=False)["input_ids"]
        )
    before, after = _tool_glue(tokenizer)
    eos = tokenizer.eos_token or ""
    if after_eos and eos and before.startswith(eos):
        before = before[len(eos) :]
    return list(
        tokenizer(before + after.replace(_SENTINEL, observation), add_special_tokens=False)["input_ids"]
    )


def _tool_glue(tokenizer) -> tuple[str, str]:
    """(the text a chat template writes after an assistant message's content, the text of a
    `tool` message with the sentinel as content plus the next assistant header)."""
    return _glue_for(tokenizer.chat_template, tokenizer)


@lru_cache(maxsize=8)
def _glue_for(template: str | None, tokenizer) -> tuple[str, str]:
    if not template:
        raise BadToolCall(
            "the model's tokenizer has no chat template for tool messages; use tool_format 'tagged'"
        )
    base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _SENTINEL + "A"}]
    text = tokenizer.apply_chat_template(base, tokenize=False)
    full = tokenizer.apply_chat_template(
        base + [{"role": "tool", "content": _SENTINEL}], tokenize=False, add_generation_prompt=True
    )
    if not full.startswith(text):
        raise BadToolCall(
            "the chat template rewrites earlier turns when a tool answers; use tool_format 'tagged'"
        )
    before = text[text.index(_SENTINEL + "A") + len(_SENTINEL) + 1 :]
    return before, full[len(text) :]

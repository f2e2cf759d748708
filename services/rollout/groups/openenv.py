"""An OpenEnv environment's action as the policy's one tool, and its observations as text
(`proto/openenv.py`; the episode loop is `episodes.py`'s).

The tool is named after the configured server; its parameters are the fields of the action's
JSON schema (`GET /schema`) but `metadata`. A call becomes the action dict:

* `hermes`: `{"name": TOOL, "arguments": {field: value, …}}` (the name must be the tool's);
* `tagged`: the text between the markers, a JSON object of fields, or, for an action with one
  string field, that field's value as written (the tool's name is not written: there is one).

The dict is checked against the schema here (unknown and missing fields, JSON types, enums)
before it is sent; what this check cannot read (`$ref`, formats, bounds) the server's own
model checks, and its refusal reaches the policy the same way: as an `[invalid_call]`
observation, counted. Not a JSON-schema implementation: only the subset pydantic emits for
flat action models is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from asyncrl.proto.environments import MAX_OBSERVATION_CHARS
from asyncrl.proto.openenv import ACTION_METADATA, OpenEnvSchema
from asyncrl.services.rollout.toolcalls import BadToolCall, ToolFormat, call_body, parse_tool_call

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


@dataclass(frozen=True)
class ActionTool:
    name: str
    description: str
    properties: dict[str, Any]
    required: tuple[str, ...]

    @classmethod
    def of(cls, name: str, schema: OpenEnvSchema, description: str = "") -> ActionTool:
        action = schema.action
        props = {k: v for k, v in (action.get("properties") or {}).items() if k != ACTION_METADATA}
        required = tuple(k for k in action.get("required", ()) if k in props)
        return cls(name, description or str(action.get("description", "")), props, required)

    def openai(self) -> dict[str, Any]:
        """The tool as an OpenAI function schema (for the chat template's `tools`)."""
        params = {"type": "object", "properties": self.properties, "required": list(self.required)}
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": params},
        }

    def action(self, text: str, fmt: ToolFormat) -> dict[str, Any] | None:
        """The action the turn's text calls for, None for a final answer; `BadToolCall` (the
        policy is told why) for a call that is not a valid action."""
        if fmt.kind == "hermes":
            call = parse_tool_call(text, fmt)
            if call is None:
                return None
            if call.name != self.name:
                raise BadToolCall(f"no tool {call.name!r}; the tool is {self.name!r}")
            fields = call.arguments if isinstance(call.arguments, dict) else self._one_string(call.arguments)
        else:
            body = call_body(text, fmt)
            if body is None:
                return None
            fields = _json_object(body)
            if fields is None:
                fields = self._one_string(body)
        self.check(fields)
        return fields

    def _one_string(self, text: str) -> dict[str, Any]:
        strings = [k for k, v in self.properties.items() if "string" in _types(v)]
        if len(self.properties) == 1 and strings:
            return {strings[0]: text}
        raise BadToolCall(
            f"the action takes the fields {sorted(self.properties)}: write them as a JSON object"
        )

    def check(self, fields: dict[str, Any]) -> None:
        unknown = sorted(set(fields) - set(self.properties))
        if unknown:
            raise BadToolCall(f"unknown action fields {unknown}; the fields are {sorted(self.properties)}")
        missing = [k for k in self.required if k not in fields]
        if missing:
            raise BadToolCall(f"missing action fields {missing}")
        for key, value in fields.items():
            spec = self.properties[key]
            types = _types(spec)
            if types and not any(_is(value, t) for t in types):
                raise BadToolCall(
                    f"action field {key!r} must be {' or '.join(types)}, got {type(value).__name__}"
                )
            if "enum" in spec and value not in spec["enum"]:
                raise BadToolCall(f"action field {key!r} must be one of {spec['enum']}")


def _types(spec: dict[str, Any]) -> list[str]:
    """The JSON types a property allows (`type`, or the `type`s of its `anyOf`); [] when it
    says none this module reads (the server checks it)."""
    if isinstance(spec.get("type"), str):
        return [spec["type"]]
    if isinstance(spec.get("type"), list):
        return [t for t in spec["type"] if isinstance(t, str)]
    options = spec.get("anyOf") or []
    types = [o.get("type") for o in options if isinstance(o, dict)]
    return [t for t in types if isinstance(t, str)] if all(isinstance(t, str) for t in types) else []


def _is(value: Any, json_type: str) -> bool:
    if isinstance(value, bool) and json_type in ("integer", "number"):
        return False  # (a JSON true is not a number, though Python's bool is an int)
    return isinstance(value, _JSON_TYPES.get(json_type, (object,)))


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def observation_text(observation: dict[str, Any]) -> str:
    """An observation dict as the policy reads it: a lone field's value (a string as is), else
    the dict as JSON; cut at MAX_OBSERVATION_CHARS."""
    if len(observation) == 1:
        (value,) = observation.values()
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    else:
        text = json.dumps(observation, ensure_ascii=False) if observation else ""
    return text[:MAX_OBSERVATION_CHARS]

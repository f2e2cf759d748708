"""Wire types shared by every asyncrl process.

Records that live in Redis (`Sample`, `Group` with its `Samples` columns, `GroupJob`,
`WeightsInfo`) are msgspec structs encoded with the msgpack codec in `proto.codec`; HTTP bodies
are pydantic models in the sibling modules. Nothing here imports torch, and importing the
package loads nothing: each name below loads its module (and numpy) when first used, so a
config can read `proto.limits` and stay fast to import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncrl.proto.codec import RecordDecodeError, decode, encode
    from asyncrl.proto.records import (
        SCHEMA_VERSION,
        FinishReason,
        Group,
        GroupJob,
        RewardStatus,
        Sample,
        Samples,
        Timings,
        WeightsInfo,
    )

__all__ = [
    "SCHEMA_VERSION",
    "FinishReason",
    "Group",
    "GroupJob",
    "RecordDecodeError",
    "RewardStatus",
    "Sample",
    "Samples",
    "Timings",
    "WeightsInfo",
    "decode",
    "encode",
]
_CODEC = {"RecordDecodeError", "decode", "encode"}  # the others are in proto.records


def __getattr__(name: str) -> object:
    if name not in __all__:
        raise AttributeError(f"module 'proto' has no attribute {name!r}")
    return getattr(
        importlib.import_module("asyncrl.proto.codec" if name in _CODEC else "asyncrl.proto.records"), name
    )

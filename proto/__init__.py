"""Wire types shared by every asyncrl process.

Records that live in Redis (`Sample`, `Group`, `GroupJob`, `WeightsInfo`) are pydantic models
encoded with the msgpack codec in `proto.codec`; HTTP bodies are pydantic models in the
sibling modules. Nothing here imports torch.
"""

from proto.codec import RecordDecodeError, decode, encode
from proto.records import (
    SCHEMA_VERSION,
    FinishReason,
    Group,
    GroupJob,
    RewardStatus,
    Sample,
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
    "Timings",
    "WeightsInfo",
    "decode",
    "encode",
]

"""Wire types shared by every asyncrl process.

Records that live in Redis (`Sample`, `Group` with its `Samples` columns, `GroupJob`,
`WeightsInfo`) are pydantic models encoded with the msgpack codec in `proto.codec`; HTTP bodies
are pydantic models in the sibling modules. Nothing here imports torch.
"""

from proto.codec import RecordDecodeError, decode, encode
from proto.records import (
    SCHEMA_VERSION,
    FinishReason,
    Group,
    GroupJob,
    RewardStatus,
    Sample,
    Samples,
    SampleView,
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
    "SampleView",
    "Samples",
    "Timings",
    "WeightsInfo",
    "decode",
    "encode",
]

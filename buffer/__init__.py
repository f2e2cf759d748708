"""Redis replay buffer: streams for jobs and groups, staleness control, admission, weights."""

from buffer.replay import Admission, ClaimedJob, ReplayBuffer, TakeResult, WeightsSubscription
from buffer.server import RedisServer, ensure_redis

__all__ = ["Admission", "ClaimedJob", "RedisServer", "ReplayBuffer", "TakeResult", "WeightsSubscription", "ensure_redis"]

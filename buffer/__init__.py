"""Redis replay buffer: streams for jobs and groups, staleness control, admission, weights."""

from buffer.evals import ClaimedEval, EvalStore
from buffer.replay import Admission, ClaimedJob, ReplayBuffer, TakeResult, WeightsSubscription
from buffer.server import RedisServer, ensure_redis

__all__ = ["Admission", "ClaimedEval", "ClaimedJob", "EvalStore", "RedisServer", "ReplayBuffer", "TakeResult", "WeightsSubscription", "ensure_redis"]

"""Redis replay buffer (docs/architecture.md §4–5): one connection (`Buffer`) shared by its parts:
groups (put, take, ack), jobs (rollout work and its record), admission, weights, the gateway's
sessions."""

from buffer.admission import AdmissionControl
from buffer.cli import stats
from buffer.connection import Buffer
from buffer.evals import ClaimedEval, EvalStore
from buffer.groups import Groups, TakeResult
from buffer.jobs import ClaimedJob, GroupReport, JobProgress, Jobs
from buffer.server import RedisServer, ensure_redis
from buffer.sessions import ClosedSession, SessionStore
from buffer.weights import Weights, WeightsSubscription

__all__ = ["AdmissionControl", "Buffer", "ClaimedEval", "ClaimedJob", "ClosedSession", "EvalStore", "GroupReport", "Groups",
           "JobProgress", "Jobs", "RedisServer", "SessionStore", "TakeResult", "Weights", "WeightsSubscription",
           "ensure_redis", "stats"]  # fmt: skip

"""Redis replay buffer (docs/architecture.md §4–5): one connection (`Buffer`) shared by its parts:
groups (put, take, ack), jobs (rollout work and its record), admission, policy versions and
their announcements, the gateway's sessions, the engine fleet's roster."""

from asyncrl.buffer.admission import AdmissionControl
from asyncrl.buffer.cli import stats
from asyncrl.buffer.connection import Buffer
from asyncrl.buffer.evals import ClaimedEval, EvalStore
from asyncrl.buffer.groups import Groups, TakeResult
from asyncrl.buffer.jobs import ClaimedJob, GroupReport, JobProgress, Jobs
from asyncrl.buffer.roster import EngineRoster
from asyncrl.buffer.server import RedisServer, ensure_redis
from asyncrl.buffer.sessions import ClosedSession, SessionStore
from asyncrl.buffer.versions import PolicyVersions, VersionSubscription

__all__ = [
    "AdmissionControl",
    "Buffer",
    "ClaimedEval",
    "ClaimedJob",
    "ClosedSession",
    "EngineRoster",
    "EvalStore",
    "GroupReport",
    "Groups",
    "JobProgress",
    "Jobs",
    "PolicyVersions",
    "RedisServer",
    "SessionStore",
    "TakeResult",
    "VersionSubscription",
    "ensure_redis",
    "stats",
]

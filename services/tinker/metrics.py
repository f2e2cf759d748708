"""Prometheus metrics of the Tinker-compatible service (docs/architecture.md §9: `asyncrl_`
prefix, base units, `_total` counters, bounded labels). Per-model series carry the model id as
a label: the number of models is bounded by `max_models`, and an unloaded model's series go
with it (`ModelCollector` reads them at each scrape)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

REQUESTS = Counter(
    "asyncrl_tinker_requests_total",
    "API calls by route and outcome (accepted, retried = a seq id seen before, refused = 4xx, limited = 429/503/413)",
    ["route", "outcome"],
)
COMMANDS = Counter(
    "asyncrl_tinker_commands_total",
    "Model commands finished, by kind and outcome (done, refused = the backend said no, error, gap, lost, "
    "released = its model was released first)",
    ["kind", "outcome"],
)
COMMAND_SECONDS = Histogram(
    "asyncrl_tinker_command_seconds",
    "Time to run one model command on the backend",
    ["kind"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
SAMPLES = Counter(
    "asyncrl_tinker_samples_total", "Sample calls finished by outcome (done, refused, error)", ["outcome"]
)
SAMPLE_SECONDS = Histogram(
    "asyncrl_tinker_sample_seconds",
    "Time from a sample call to its result",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
TELEMETRY_EVENTS = Counter(
    "asyncrl_tinker_sdk_telemetry_events_total", "SDK telemetry events received and dropped (not stored)"
)
SESSIONS_EXPIRED = Counter(
    "asyncrl_tinker_sessions_expired_total",
    "Sessions ended for want of a heartbeat (session_timeout_s): their models released",
)
WORKER_ERRORS = Counter(
    "asyncrl_tinker_worker_errors_total", "Worker passes that failed outside any command (Redis down, a bug)"
)
RECOVERED = Counter(
    "asyncrl_tinker_recovered_models_total",
    "Models found in Redis at start, by outcome (restored, lost = state after its checkpoint gone, failed = its "
    "restore point could not be built, pending = not yet created, released = its session ended)",
    ["outcome"],
)


class ModelCollector(Collector):
    """Per-model gauges read at each scrape: the backend's own figures (`TinkerTrainer.metrics`)
    and the queue depth per model, of every service app in the process (one, but for tests).
    Registered once; apps add and remove their sources."""

    def __init__(self) -> None:
        self.sources: dict[
            int, tuple[Callable[[], dict[str, dict[str, float]]], Callable[[], dict[str, int]]]
        ] = {}

    def add(self, key: int, backend_metrics, queued) -> None:
        self.sources[key] = (backend_metrics, queued)

    def remove(self, key: int) -> None:
        self.sources.pop(key, None)

    def collect(self):
        queued = GaugeMetricFamily(
            "asyncrl_tinker_model_queued_commands", "Commands of a model waiting or running", labels=["model"]
        )
        families: dict[str, GaugeMetricFamily] = {}
        for backend_metrics, depth in list(self.sources.values()):
            for mid, n in depth().items():
                queued.add_metric([mid], n)
            for mid, figures in backend_metrics().items():
                for name, value in figures.items():
                    metric = "asyncrl_tinker_model_" + "".join(c if c.isalnum() else "_" for c in name)
                    family = families.setdefault(
                        metric,
                        GaugeMetricFamily(metric, f"Backend figure {name!r} of a model", labels=["model"]),
                    )
                    family.add_metric([mid], float(value))
        yield queued
        yield from families.values()


MODELS = ModelCollector()
REGISTRY.register(MODELS)

"""What `asyncrl demo` reads off the services' /metrics: the trainer's curve at each poll, and
the engines' and trainer's busy and idle counters once the run ends.

Read-only, and a service that does not answer gives no reading (None, or nothing), not an
error. The Prometheus scrape config `asyncrl up` writes into a run directory is
services/ops/scrape.py, not this.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import httpx

from asyncrl.proto.states import GroupState


@dataclass
class Scrape:
    """What the demo reads off the trainer's /metrics each poll."""

    elapsed_s: float  # since the demo started
    version: int
    reward: float | None
    entropy: float | None
    tokens_per_s: float | None
    staleness_sum: float
    staleness_count: float
    staleness_max_bucket: float | None
    dropped: float
    staleness_buckets: list[tuple[float, float]] = field(default_factory=list)  # (le, cumulative groups)


def scrape_trainer(url: str, t0: float) -> Scrape | None:
    try:
        text = httpx.get(f"{url}/metrics", timeout=2.0).text
    except httpx.HTTPError:
        return None
    values: dict[str, float] = {}
    buckets: list[tuple[float, float]] = []
    dropped = 0.0
    for name, labels, value in _samples(text, SCRAPED):
        if name == "asyncrl_trainer_group_staleness_bucket":
            buckets.append((float(labels["le"]), value))
        elif name == "asyncrl_trainer_groups_total" and labels.get("outcome") not in (
            GroupState.trained,
            None,
        ):
            dropped += value
        elif not labels:
            values[name] = value
    count = values.get("asyncrl_trainer_group_staleness_count", 0.0)
    # the largest staleness seen is the first bucket bound that already holds every observation
    max_bucket = next((le for le, c in sorted(buckets) if c >= count), None) if count else None
    version = int(values.get("asyncrl_trainer_version", 0))
    return Scrape(
        elapsed_s=time.monotonic() - t0,
        version=version,
        # before the first step the trainer's gauges hold their initial 0, not a measurement
        reward=values.get("asyncrl_trainer_reward_mean") if version else None,
        entropy=values.get("asyncrl_trainer_entropy") if version else None,
        tokens_per_s=values.get("asyncrl_trainer_tokens_per_second") if version else None,
        staleness_sum=values.get("asyncrl_trainer_group_staleness_sum", 0.0),
        staleness_count=count,
        staleness_max_bucket=max_bucket,
        dropped=dropped,
        staleness_buckets=sorted(buckets),
    )


# The trainer's samples the demo reads: only their lines are parsed (prometheus_client's parser
# read every family of the page, twice a second: a third of a core-second per minute of demo).
SCRAPED = frozenset(
    {
        "asyncrl_trainer_version",
        "asyncrl_trainer_reward_mean",
        "asyncrl_trainer_entropy",
        "asyncrl_trainer_tokens_per_second",
        "asyncrl_trainer_group_staleness_sum",
        "asyncrl_trainer_group_staleness_count",
        "asyncrl_trainer_group_staleness_bucket",
        "asyncrl_trainer_groups_total",
    }
)


def _samples(text: str, names: frozenset[str]):
    """(name, labels, value) of the samples of `names` in a Prometheus text page (the exposition
    format prometheus_client writes: `name{k="v",…} value`, label values without `",` inside)."""
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        head, _, value = line.rpartition(" ")
        name, _, rest = head.partition("{")
        if name not in names:
            continue
        labels = (
            dict(pair.split("=", 1) for pair in rest.rstrip("}").split(",") if "=" in pair) if rest else {}
        )
        yield name, {k: v.strip('"') for k, v in labels.items()}, float(value)


def scrape_samples(url: str):
    """Every sample on a service's /metrics (none when it does not answer)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{url}/metrics", timeout=5.0).text
    except httpx.HTTPError:
        return []
    return [s for f in text_string_to_metric_families(text) for s in f.samples]


def scrape_counters(url: str, names: tuple[str, ...]) -> dict[str, float]:
    """Unlabelled samples of `names` from a service's /metrics (missing ones are left out)."""
    return {s.name: s.value for s in scrape_samples(url) if s.name in names and not s.labels}


def utilisation(launcher, wall_s: float) -> dict[str, float | None]:
    """Engine busy ratio and trainer idle ratio over the run, from the services' counters."""
    busy = [
        scrape_counters(u, ("asyncrl_engine_busy_seconds_total",)).get("asyncrl_engine_busy_seconds_total")
        for u in launcher.engine_urls
    ]
    t = scrape_counters(
        launcher.trainer_url, ("asyncrl_trainer_idle_seconds_total", "asyncrl_trainer_busy_seconds_total")
    )
    idle, tbusy = t.get("asyncrl_trainer_idle_seconds_total"), t.get("asyncrl_trainer_busy_seconds_total")
    known = [b for b in busy if b is not None]
    shares = (
        {"engine": launcher.engine_urls[:1], "trainer": [launcher.trainer_url]} if launcher.core_share else {}
    )
    return {
        "engine_busy_ratio": sum(known) / (len(known) * wall_s) if known and wall_s > 0 else None,
        "trainer_idle_ratio": idle / (idle + tbusy) if idle is not None and tbusy else None,
        "trainer_idle_s": idle,
        "trainer_busy_s": tbusy,
        # core sharing: seconds each had work, by torch threads it used, and seconds it waited for a core
        "core_share": {role: core_share_seconds(urls[0], role) for role, urls in shares.items() if urls}
        or None,
    }


def core_share_seconds(url: str, role: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in scrape_samples(url):
        if s.labels.get("role") != role:
            continue
        if s.name == "asyncrl_core_share_busy_seconds_total":
            out[f"busy_s_{s.labels['threads']}_threads"] = round(s.value, 1)
        elif s.name == "asyncrl_core_share_wait_seconds_total":
            out["wait_s"] = round(s.value, 2)
    return out

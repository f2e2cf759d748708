"""An engine pod's membership of the rollout service's engine fleet (docs/architecture.md §7
"Engine fleet"; deploy/README.md "Kubernetes"): the pod adds its engine once the engine is up,
and takes it out before the engine stops. The rollout does the rest: it brings the engine to the
current weights and only then adds it to sglang-router, so a new pod never serves its start
weights.

    fleet_member.py join    the `fleet-member` sidecar: once the engine answers GET /health on
                            loopback, POST /v1/engines {"url"} to the rollout until it answers
                            200, then idle until SIGTERM.
    fleet_member.py leave   the engine container's preStop hook: stop the sidecar from joining,
                            then DELETE /v1/engines?url= until 200 or 404, so the router sends the
                            engine nothing more before the engine gets SIGTERM.

Environment (the same in both containers):
    ASYNCRL_FLEET_ROLLOUT_URL  the rollout service, e.g. http://rollout:8001
    ASYNCRL_FLEET_ENGINE_URL   how the rollout and the router reach this engine: its stable
                               StatefulSet name, e.g. http://sglang-0.sglang:30000; the sidecar
                               probes the same port on loopback
    ASYNCRL_ENGINE_API_TOKEN   the engine token, which the rollout's /v1/engines require
    ASYNCRL_API_TOKEN          used instead when no engine token is set (as on deploy/k8s)
    ASYNCRL_FLEET_STATE_DIR    a directory both containers mount (an emptyDir): the join lock
                               and the `leaving` mark live there

Both commands are idempotent: joining an engine that serves is answered at once and changes
nothing (a restarted sidecar joins again), leaving when the fleet does not have the engine is
done (404). A join is retried while it may still succeed (no answer, 5xx, 409: the engine could
not load the current weights yet, or the rollout has no router_url, 429); any other refusal
(401/403: the token, 422) exits 1, and the kubelet restarts the sidecar with its back-off. A
join in flight holds the lock, which `leave` waits for (at most LOCK_WAIT_S), so no join starts
after a leave.

Standard library only, Python >= 3.8: it runs on the engine image's own interpreter (SGLang's or
asyncrl's), mounted from a ConfigMap. Not a security boundary: anyone with the token can change
the fleet.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

HEALTH_POLL_S = 2.0  # between two probes of the engine's /health while it loads
HEALTH_TIMEOUT_S = 5.0
JOIN_TIMEOUT_S = 900.0  # a join loads the current weights (weight_update_timeout_s) and waits for the router
RETRY_FIRST_S = 1.0  # the first wait after a refused join; it doubles up to RETRY_MAX_S
RETRY_MAX_S = 30.0
RETRIED = frozenset({408, 409, 425, 429, 500, 502, 503, 504})  # refusals a later join may not get
LEAVE_DEADLINE_S = 90.0  # the whole leave; the pod's terminationGracePeriodSeconds must exceed it
LOCK_WAIT_S = 30.0  # the part of it a leave waits for a join in flight to be answered
LEAVING = "leaving"  # the mark, in ASYNCRL_FLEET_STATE_DIR, that stops every later join


class Settings:
    def __init__(self, environ: dict[str, str]):
        missing = [
            name
            for name in ("ASYNCRL_FLEET_ROLLOUT_URL", "ASYNCRL_FLEET_ENGINE_URL", "ASYNCRL_FLEET_STATE_DIR")
            if not environ.get(name)
        ]
        if missing:
            raise SystemExit(f"fleet_member: set {', '.join(missing)}")
        self.rollout = environ["ASYNCRL_FLEET_ROLLOUT_URL"].rstrip("/")
        self.engine = environ["ASYNCRL_FLEET_ENGINE_URL"].rstrip("/")
        self.state_dir = environ["ASYNCRL_FLEET_STATE_DIR"]
        port = urllib.parse.urlsplit(self.engine).port or 80
        self.health = f"http://127.0.0.1:{port}/health"  # the engine in this pod, on loopback
        # the rollout's /v1/engines take the engine token (it is what a join sends the engine):
        # ASYNCRL_ENGINE_API_TOKEN, else ASYNCRL_API_TOKEN, the same fallback as the services'
        token = environ.get("ASYNCRL_ENGINE_API_TOKEN") or environ.get("ASYNCRL_API_TOKEN", "")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}


def log(message: str) -> None:
    print(f"fleet_member: {message}", file=sys.stderr, flush=True)


def call(method: str, url: str, headers: dict[str, str], timeout_s: float, body=None) -> tuple[int, str]:
    """(status, body text); status 0 when nothing answered (the text says why)."""
    data = None if body is None else json.dumps(body).encode()
    headers = dict(headers, **({"Content-Type": "application/json"} if data is not None else {}))
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except OSError as exc:  # refused, reset, unresolvable, timed out
        return 0, f"{type(exc).__name__}: {exc}"


def engine_up(settings: Settings) -> bool:
    return call("GET", settings.health, {}, HEALTH_TIMEOUT_S)[0] == 200


def join(settings: Settings) -> int:
    """POST until 200 (then idle until SIGTERM), or exit 1 on a refusal a retry cannot change."""
    lock = open(os.path.join(settings.state_dir, "lock"), "a")  # noqa: SIM115 - held for the life of the process
    wait_s = RETRY_FIRST_S
    while True:
        if not engine_up(settings):
            time.sleep(HEALTH_POLL_S)
            continue
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if os.path.exists(os.path.join(settings.state_dir, LEAVING)):
                log(f"{settings.engine} is leaving: not joining")
                break
            status, text = call(
                "POST",
                f"{settings.rollout}/v1/engines",
                settings.headers,
                JOIN_TIMEOUT_S,
                {"url": settings.engine},
            )
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
        if status == 200:
            log(f"{settings.engine} joined the fleet: {text}")
            break
        if status and status not in RETRIED:
            log(f"{settings.engine} not joined, refused for good ({status}): {text[:500]}")
            return 1
        log(
            f"{settings.engine} not joined yet ({status or 'no answer'}): {text[:500]}; again in {wait_s:g} s"
        )
        time.sleep(wait_s)
        wait_s = min(2 * wait_s, RETRY_MAX_S)
    while True:  # a sidecar that exits is restarted: it idles until the pod stops
        time.sleep(3600)


def leave(settings: Settings) -> int:
    """Stop later joins, then DELETE until 200 or 404 (0), or until LEAVE_DEADLINE_S (1)."""
    deadline = time.monotonic() + LEAVE_DEADLINE_S
    lock_deadline = time.monotonic() + LOCK_WAIT_S
    with open(os.path.join(settings.state_dir, "lock"), "a") as lock:
        while True:  # a join in flight is answered first, so that this leave comes after it
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > lock_deadline:
                    log("a join is still in flight: leaving without waiting for it")
                    break
                time.sleep(0.2)
        with open(os.path.join(settings.state_dir, LEAVING), "w") as mark:
            mark.write(settings.engine)
    url = f"{settings.rollout}/v1/engines?{urllib.parse.urlencode({'url': settings.engine})}"
    wait_s = RETRY_FIRST_S
    while True:
        status, text = call("DELETE", url, settings.headers, max(deadline - time.monotonic(), 1.0))
        if status in (200, 404):
            log(f"{settings.engine} left the fleet ({status})")
            return 0
        if status and status not in RETRIED:
            log(f"{settings.engine} did not leave, refused for good ({status}): {text[:500]}")
            return 1
        if time.monotonic() + wait_s > deadline:
            log(
                f"{settings.engine} did not leave within {LEAVE_DEADLINE_S:g} s ({status or 'no answer'}): {text[:500]}"
            )
            return 1
        log(
            f"{settings.engine} has not left yet ({status or 'no answer'}): {text[:500]}; again in {wait_s:g} s"
        )
        time.sleep(wait_s)
        wait_s = min(2 * wait_s, RETRY_MAX_S)


def main(argv: list[str]) -> int:
    if argv not in (["join"], ["leave"]):
        log("usage: fleet_member.py join|leave")
        return 2
    # As PID 1 of its container the sidecar gets no default SIGTERM action: exit on it.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    settings = Settings(dict(os.environ))
    return join(settings) if argv == ["join"] else leave(settings)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

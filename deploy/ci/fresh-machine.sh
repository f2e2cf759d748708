#!/usr/bin/env bash
# A fresh clone's `make demo` and `make test` on a fresh Debian 12 machine of this CI kind,
# with nothing installed by hand (`make fresh-machine`). Needs root and Debian bookworm's apt
# sources. Usage: fresh-machine.sh [--rebuild] [GIT_REF] [-- COMMANDS]  (GIT_REF: default
# HEAD; COMMANDS: default `make demo ARGS="--time-limit 120" && make test`). What it does:
#
#   1. a Debian bookworm root filesystem: `debootstrap --variant=minbase` from the machine's apt
#      mirror, then only what such a machine has before anyone touches it: Debian's python3
#      (3.11), python3-venv, python3-pip, python3-dev, gcc, make, git, ca-certificates
#      (--no-install-recommends), with the machine's apt sources, apt settings and policy-rc.d
#      (services never start on install). No redis-server, bubblewrap, docker-compose,
#      prometheus: `make test` installs those itself (deploy/ci/system-packages.sh). Cached as
#      a tarball under /var/tmp (its name hashes the package list and the apt sources), so a
#      second run skips debootstrap; --rebuild (or ASYNCRL_FRESH_REBUILD=1) builds it again;
#   2. per run, on an unpacked copy: the machine's own setup of the kind: its local CA
#      certificates (the egress proxy's), its pip config files and their constraints file,
#      its PIP_* environment, /opt/wheels, /opt/pypi and /opt/pypi-more bind-mounted
#      read-only at the same paths (so `pip install torch==2.13.0` takes the local CPU wheel),
#      /etc/resolv.conf and /etc/hosts. The network is the host's (pip and apt need it);
#   3. GIT_REF (resolved in the repository this script lives in) pushed alone to a bare
#      repository, bind-mounted read-only at /src/asyncrl.git;
#   4. a real container, not a chroot (bubblewrap, which the tests use, cannot create user
#      namespaces from inside a chroot): `unshare --mount --pid --fork`, the root filesystem
#      bound onto itself, /proc, /sys, a private /dev (device nodes, devpts, /dev/shm), tmpfs
#      /tmp and /run, `pivot_root` and the old root unmounted; then, as root with a login
#      environment, `cd /root && git clone file:///src/asyncrl.git asyncrl && cd asyncrl &&
#      COMMANDS`;
#   5. the commands' whole output in a log file on the host (/var/tmp/asyncrl-fresh-*.log, its
#      path printed at the end; also shown live unless ASYNCRL_FRESH_QUIET=1); the exit status
#      is the commands'. On any exit: the container's pid namespace killed (every process in
#      it dies with its init), its mounts gone with it, anything left mounted under the work
#      directory lazily unmounted, the work directory removed; the cached tarball and the log
#      are kept. Nothing on the host is touched (its Redis on 6379 included): the container
#      only shares the host's network.
#
# Environment: ASYNCRL_FRESH_CACHE (directory of the cached tarball, default /var/tmp),
# ASYNCRL_FRESH_REBUILD=1, ASYNCRL_FRESH_QUIET=1, ASYNCRL_FRESH_KEEP=1 (keep the work
# directory, to debug).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
T0=$(date +%s)
STAMP=$(date +%Y%m%d-%H%M%S)
LOG=/var/tmp/asyncrl-fresh-$STAMP.log
CACHE_DIR=${ASYNCRL_FRESH_CACHE:-/var/tmp}
PACKAGES="python3 python3-venv python3-pip python3-dev gcc libc6-dev make git ca-certificates"
ROOTFS_VERSION=1  # bump when the build below changes
PATH_IN=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

log() { printf '[fresh-machine %4ss] %s\n' "$(($(date +%s) - T0))" "$*" | tee -a "$LOG" >&2; }
die() { log "FAIL: $*"; exit 1; }
# shellcheck source=deploy/ci/lib.sh
. "$(dirname "$0")/lib.sh"  # stop_pid, mirror
usage() { sed -n '2,5s/^# \{0,1\}//p' "$0"; }

REBUILD=${ASYNCRL_FRESH_REBUILD:-0}
REF=""
COMMANDS='make demo ARGS="--time-limit 120" && make test'
while [ $# -gt 0 ]; do
    case $1 in
        --rebuild) REBUILD=1; shift ;;
        -h | --help) usage; exit 0 ;;
        --) shift; [ $# -gt 0 ] || { usage >&2; exit 2; }; COMMANDS="$*"; break ;;
        -*) usage >&2; exit 2 ;;
        *) [ -z "$REF" ] || { usage >&2; exit 2; }; REF=$1; shift ;;
    esac
done
REF=${REF:-HEAD}

: >"$LOG"
[ "$(id -u)" -eq 0 ] || die "needs root (debootstrap, mount namespaces, pivot_root)"
SHA=$(git -C "$ROOT" rev-parse --verify --quiet "$REF^{commit}") || die "no commit $REF in $ROOT"
WORK=$(mktemp -d /var/tmp/asyncrl-fresh.XXXXXX)

# --- cleanup, armed before anything changes ------------------------------------------------
CHILD=""  # the host pid of the `unshare` running now; its child is the container's init


cleanup() {
    local rc=$?
    set +e
    trap - EXIT INT TERM
    if [ -n "$CHILD" ]; then
        # The container's init, killed: the kernel kills every other process of its pid
        # namespace with it. (unshare ignores TERM while it waits; --kill-child sends its
        # child SIGKILL should unshare itself die.)
        for init in $(cat "/proc/$CHILD/task/$CHILD/children" 2>/dev/null); do kill -9 "$init" 2>/dev/null; done
        stop_pid "$CHILD" 10
        wait "$CHILD" 2>/dev/null
    fi
    # The container's mounts live in its own mount namespace and went with it; whatever a
    # killed step may have left in the host's under $WORK is unmounted here, deepest first.
    grep -o " $WORK/[^ ]*" /proc/mounts | sort -r | xargs -r -n1 umount -l 2>/dev/null
    if [ "${ASYNCRL_FRESH_KEEP:-0}" = 1 ]; then
        log "ASYNCRL_FRESH_KEEP=1: leaving $WORK in place"
    elif grep -q " $WORK/" /proc/mounts; then
        log "still mounted under $WORK: not removing it"
    else
        rm -rf --one-file-system "$WORK"
    fi
    log "done: exit $rc, $(($(date +%s) - T0)) s in all; log: $LOG"
    exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

run_container() {  # run_container SCRIPT ARGS...: SCRIPT (host bash) in new mount + pid namespaces
    local rc=0
    unshare --mount --propagation private --pid --fork --kill-child --mount-proc \
        nice -n 10 bash "$@" </dev/null >>"$LOG" 2>&1 &
    CHILD=$!
    if [ "${ASYNCRL_FRESH_QUIET:-0}" != 1 ]; then tail -n 0 -f --pid="$CHILD" "$LOG" >&2 & fi
    wait "$CHILD" || rc=$?
    CHILD=""
    sleep 1  # let tail print the last lines
    return $rc
}

# --- 1. the root filesystem, built once ------------------------------------------------------
debian_sources() {  # the machine's apt source files that name a Debian archive
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] && grep -qE '^(URIs:|deb ).*/debian(-security)?/?( |$)' "$f" && echo "$f"
    done
    return 0
}
MIRROR=$(mirror)
[ -n "$MIRROR" ] || die "no Debian mirror in the apt sources"
mapfile -t SOURCES < <(debian_sources)
KEY=$({
    echo "$ROOTFS_VERSION bookworm minbase $MIRROR $PACKAGES"
    cat "${SOURCES[@]}" /etc/apt/apt.conf.d/* /usr/sbin/policy-rc.d 2>/dev/null
} | sha256sum | cut -c1-12)
TARBALL=$CACHE_DIR/asyncrl-fresh-rootfs-bookworm-$KEY.tar

if [ "$REBUILD" = 1 ] || ! [ -s "$TARBALL" ]; then
    if ! command -v debootstrap >/dev/null; then
        log "installing debootstrap"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null ||
            { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null; } ||
            die "apt-get install debootstrap"
    fi
    log "building the root filesystem: debootstrap --variant=minbase bookworm from $MIRROR, then $PACKAGES"
    # After debootstrap, what apt and dpkg take from the machine: its Debian sources
    # (bookworm, bookworm-updates, security), its apt settings and its policy-rc.d (services
    # are not started by their packages' install scripts), in a plain chroot (enough for apt).
    cat >"$WORK/build.sh" <<'BUILD'
set -euo pipefail
B=$1 MIRROR=$2 PACKAGES=$3 OUT=$4 PATH_IN=$5
shift 5
debootstrap --variant=minbase bookworm "$B" "$MIRROR"
rm -f "$B/etc/apt/sources.list"
for f in "$@"; do cp "$f" "$B/etc/apt/${f#/etc/apt/}"; done
cp -a /etc/apt/apt.conf.d/. "$B/etc/apt/apt.conf.d/"
[ -f /usr/sbin/policy-rc.d ] && cp -a /usr/sbin/policy-rc.d "$B/usr/sbin/policy-rc.d"
cp /etc/resolv.conf "$B/etc/resolv.conf"
mount -t proc proc "$B/proc"
mount --rbind /sys "$B/sys"
mount --rbind /dev "$B/dev"
in_root() { chroot "$B" /usr/bin/env -i PATH="$PATH_IN" HOME=/root LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive "$@"; }
in_root apt-get update -qq
# shellcheck disable=SC2086
in_root apt-get install -y -qq --no-install-recommends $PACKAGES
in_root apt-get clean
rm -rf "$B"/var/lib/apt/lists/* "$B"/var/cache/apt/*.bin
in_root dpkg-query -W -f '${Package}=${Version}\n' >"$OUT.packages"
umount -l "$B/proc" "$B/sys" "$B/dev"
: >"$B/etc/resolv.conf"
tar --numeric-owner --xattrs --one-file-system -C "$B" -cf "$OUT" .
BUILD
    run_container "$WORK/build.sh" "$WORK/build" "$MIRROR" "$PACKAGES" "$WORK/rootfs.tar" "$PATH_IN" "${SOURCES[@]}" ||
        die "building the root filesystem failed (see $LOG)"
    mv "$WORK/rootfs.tar.packages" "${TARBALL%.tar}.packages"
    mv "$WORK/rootfs.tar" "$TARBALL"
    rm -rf --one-file-system "$WORK/build"
    log "root filesystem cached: $TARBALL ($(du -h "$TARBALL" | cut -f1), $(wc -l <"${TARBALL%.tar}.packages") packages)"
else
    log "cached root filesystem $TARBALL (--rebuild to build it again)"
fi

# --- 2. this run's copy, with the machine kind's own setup -------------------------------------
R=$WORK/root
mkdir -p "$R"
tar --numeric-owner --xattrs -C "$R" -xf "$TARBALL"
# The container shares the host's network and host name: the machine's resolver and its
# /etc/hosts (its own name resolves there; torch.distributed's gloo looks it up).
cp /etc/resolv.conf /etc/hosts "$R/etc/"
# The local CA certificates (update-ca-certificates' local directory: the egress proxy's).
if compgen -G '/usr/local/share/ca-certificates/*.crt' >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$R/usr/local/share/ca-certificates/"
    chroot "$R" /usr/bin/env -i PATH="$PATH_IN" update-ca-certificates >/dev/null 2>&1 ||
        die "update-ca-certificates in the root filesystem"
fi
# pip's config files as the machine's pip loads them (global and user; a site file belongs
# to one interpreter), and the constraint files they name.
mapfile -t PIP_FILES < <(
    {
        python3 -m pip config list -v 2>/dev/null | sed -n "s/^For variant '\(global\|user\)', will try loading '\(.*\)'$/\2/p"
        printf '%s\n' /etc/pip.conf /etc/xdg/pip/pip.conf /root/.config/pip/pip.conf /root/.pip/pip.conf
    } | sort -u
)
for f in "${PIP_FILES[@]}"; do
    [ -f "$f" ] || continue
    mkdir -p "$R$(dirname "$f")"
    cp "$f" "$R$f"
    sed -n 's/^[[:space:]]*constraint[[:space:]]*=[[:space:]]*//p' "$f" | tr ' ' '\n' | while read -r c; do
        c=${c#file://}
        [ -f "$c" ] && mkdir -p "$R$(dirname "$c")" && cp "$c" "$R$c"
    done
    log "pip config $f"
done
[ -n "${PIP_CONSTRAINT:-}" ] && [ -f "$PIP_CONSTRAINT" ] && mkdir -p "$R$(dirname "$PIP_CONSTRAINT")" && cp "$PIP_CONSTRAINT" "$R$PIP_CONSTRAINT"
mapfile -t PIP_ENV < <(env | grep -E '^PIP_[A-Z_]+=' || true)
log "pip environment: ${PIP_ENV[*]:-none}"
BINDS=()
for d in /opt/wheels /opt/pypi /opt/pypi-more; do
    [ -d "$d" ] && BINDS+=("$d") && mkdir -p "$R$d"
done
log "read-only at the same paths: ${BINDS[*]:-none}"

# --- 3. the ref, alone in a bare repository --------------------------------------------------
mkdir -p "$WORK/src" "$R/src/asyncrl.git"
git init -q --bare -b main "$WORK/src/asyncrl.git"
git -C "$ROOT" push -q "$WORK/src/asyncrl.git" "$SHA:refs/heads/main"
log "ref $REF = $SHA: $(git -C "$ROOT" log -1 --format=%s "$SHA")"

# --- 4. the container ------------------------------------------------------------------------
printf '%s\n' "$COMMANDS" >"$WORK/commands.sh"
cat >"$WORK/enter.sh" <<'ENTER'
set -euo pipefail
R=$1 WORK=$2 T0=$3 PATH_IN=$4
shift 4
mount --bind "$R" "$R"
mount -t proc proc "$R/proc"
mount --rbind /sys "$R/sys"
# A private /dev as container runtimes make it: the usual device nodes bound from the host, its
# own devpts instance, tmpfs /dev/shm.
mount -t tmpfs -o mode=755,nosuid,size=64k dev "$R/dev"
for n in null zero full random urandom tty; do touch "$R/dev/$n"; mount --bind "/dev/$n" "$R/dev/$n"; done
mkdir "$R/dev/pts" "$R/dev/shm"
mount -t devpts -o newinstance,ptmxmode=0666,mode=620,gid=5 devpts "$R/dev/pts"
ln -s pts/ptmx "$R/dev/ptmx"
mount -t tmpfs -o mode=1777,nosuid,nodev shm "$R/dev/shm"
ln -s /proc/self/fd "$R/dev/fd"
ln -s /proc/self/fd/0 "$R/dev/stdin"; ln -s /proc/self/fd/1 "$R/dev/stdout"; ln -s /proc/self/fd/2 "$R/dev/stderr"
mount -t tmpfs -o mode=1777,nosuid,nodev tmp "$R/tmp"
mount -t tmpfs -o mode=755,nosuid,nodev run "$R/run"
mkdir -p "$R/run/fresh" "$R/run/lock"
cp "$WORK/commands.sh" "$R/run/fresh/commands.sh"
mount --bind -o ro "$WORK/src/asyncrl.git" "$R/src/asyncrl.git"
for d in "$@"; do mount --bind -o ro "$d" "$R$d"; done
cd "$R"
mkdir -p .oldroot
pivot_root . .oldroot
cd /
umount -l /.oldroot
rmdir /.oldroot
mapfile -t PIP_ENV < <(env | grep -E '^PIP_[A-Z_]+=' || true)
# As root logged in on the machine: Debian's PATH and nothing of the host's but pip's variables.
exec /usr/bin/env -i PATH="$PATH_IN" HOME=/root USER=root LOGNAME=root SHELL=/bin/bash \
    LANG=C.UTF-8 TERM=dumb DEBIAN_FRONTEND=noninteractive FRESH_T0="$T0" "${PIP_ENV[@]}" \
    /bin/bash -c '
say() { printf "[fresh-machine %4ss] (container) %s\n" "$(($(date +%s) - FRESH_T0))" "$*"; }
set -e
say "$(. /etc/os-release && echo "$PRETTY_NAME"), $(python3 --version), pid $$, root $(findmnt -no SOURCE / | head -1)"
cd /root
git clone -q file:///src/asyncrl.git asyncrl
cd asyncrl
say "cloned $(git log -1 --format="%h %s")"
say "running: $(cat /run/fresh/commands.sh)"
set +e
bash /run/fresh/commands.sh
rc=$?
say "commands exited $rc"
exit $rc
'
ENTER
log "container: $R (log $LOG)"
rc=0
run_container "$WORK/enter.sh" "$R" "$WORK" "$T0" "$PATH_IN" "${BINDS[@]}" || rc=$?
log "commands exited $rc"
exit $rc

# Shell functions the CI scripts share (sourced by compose-up.sh and fresh-machine.sh).

stop_pid() {  # stop_pid PID SECONDS: TERM, wait, then KILL; only the process we started
    local pid=$1 wait_s=$2
    kill -0 "$pid" 2>/dev/null || return 0
    kill "$pid" 2>/dev/null || true
    for _ in $(seq "$wait_s"); do kill -0 "$pid" 2>/dev/null || return 0; sleep 1; done
    kill -9 "$pid" 2>/dev/null || true
}

mirror() {  # the Debian mirror of the machine's apt sources (deb822 or one-line format)
    cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null |
        awk '/^URIs:/ {for (i = 2; i <= NF; i++) print $i} /^deb / {print ($2 ~ /^\[/) ? $3 : $2}' |
        grep -E '/debian/?$' | head -1 || true
}

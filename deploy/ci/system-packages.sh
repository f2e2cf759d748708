#!/usr/bin/env bash
# Install the Debian packages a group of deploy/ci/system-packages.txt needs, when some are
# missing: `system-packages.sh test [compose …]`. Present commands are never reinstalled, so
# a machine set up once costs nothing. As root it runs apt-get; otherwise sudo, when sudo works
# without a password. Where neither can, it stops at once and prints the one command to run.
set -euo pipefail

LIST="$(dirname "$0")/system-packages.txt"
[ $# -gt 0 ] || { echo "usage: $0 GROUP [GROUP ...]  (groups: $(awk '!/^#/ && NF {print $1}' "$LIST" | sort -u | xargs))" >&2; exit 2; }

missing=()
for group in "$@"; do
    grep -q "^$group " "$LIST" || { echo "system-packages: no group '$group' in $LIST" >&2; exit 2; }
    while read -r g cmd pkg _; do
        [ "$g" = "$group" ] || continue
        command -v "$cmd" >/dev/null 2>&1 || PATH="$PATH:/usr/sbin:/sbin" command -v "$cmd" >/dev/null 2>&1 ||
            missing+=("$pkg")
    done < <(grep -v '^#' "$LIST")
done
[ ${#missing[@]} -eq 0 ] && exit 0

mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
install_cmd="apt-get update -qq && apt-get install -y -qq --no-install-recommends ${missing[*]}"
if [ "$(id -u)" -eq 0 ]; then
    sudo=""
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    sudo="sudo"
else
    echo "system-packages: missing ${missing[*]}; this user cannot install them (not root, no password-less sudo)." >&2
    echo "Run this once, then the command again:" >&2
    echo "    sudo sh -c '$install_cmd'" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "system-packages: missing ${missing[*]}, and this is not a Debian/Ubuntu machine (no apt-get): install the equivalents of these Debian packages, then the command again." >&2
    exit 1
fi
echo "system-packages: installing ${missing[*]} (first run only)" >&2
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null

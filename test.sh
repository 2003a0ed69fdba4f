#!/bin/sh
# Set up everything the tests need and run the whole suite (what CI runs).
# apt waits up to 5 minutes for a lock another install holds.
# As root with apt it installs the system parts: bcc + kernel headers (the real eBPF
# path), tmux (UI end-to-end) and Chromium (web view); otherwise those tests say what
# is missing and skip.
set -eu
cd "$(dirname "$0")"
. ./.ci/venv.sh
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    need=""
    for pkg in tmux chromium; do
        command -v "$pkg" >/dev/null 2>&1 || need="$need $pkg"
    done
    if [ -n "$need" ]; then
        echo "test.sh: installing$need"
        { apt-get -o DPkg::Lock::Timeout=300 update -q && apt-get -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends $need; } </dev/null \
            || echo "test.sh: could not install$need; the tests that need them will skip"
    fi
    sh .ci/install-bpf.sh
fi
ensure_venv "[test]"
exec .venv/bin/python -m pytest "$@"

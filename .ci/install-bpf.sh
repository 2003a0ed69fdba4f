#!/bin/sh
# Make the real eBPF path runnable: bcc (python3-bpfcc), kernel headers, the
# /lib/modules/$(uname -r)/{build,source} links, and a mounted tracefs.
# Idempotent; needs root and apt. Anything missing is reported and skipped
# with exit 0, so the tests fall back to procfs and say why.
set -u
export DEBIAN_FRONTEND=noninteractive

say() { echo "install-bpf: $*"; }

if [ "$(id -u)" != "0" ]; then
    say "not root: skipping (eBPF tests will skip, procfs fallback is used)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    say "apt-get not available: skipping (install bcc and kernel headers by hand)"
    exit 0
fi

krel="$(uname -r)"
need=""
[ -e /usr/lib/python3/dist-packages/bcc/__init__.py ] || need="$need python3-bpfcc"
ls -d /usr/src/linux-headers-*-amd64 >/dev/null 2>&1 || need="$need linux-headers-amd64"
if [ -n "$need" ]; then
    say "installing:$need"
    # stdin closed: a prompt must never hang CI.
    if ! { apt-get -o DPkg::Lock::Timeout=300 update -q && apt-get -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends $need; } </dev/null; then
        say "apt-get install failed: skipping"
        exit 0
    fi
fi

# A distro kernel ships matching headers; a custom kernel (no /lib/modules dir)
# gets the newest Debian headers. bcc builds tracepoint args from the live
# tracefs format, so a nearby version is enough for tracepoint-only programs.
moddir="/lib/modules/$krel"
if [ ! -e "$moddir/build/include" ] || [ ! -e "$moddir/source/include/linux/kconfig.h" ]; then
    hdr="$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n 1)"
    if [ -z "$hdr" ]; then
        say "no /usr/src/linux-headers-*-amd64 after install: skipping"
        exit 0
    fi
    # Debian splits the tree: arch-generated files in -amd64, the rest in
    # -common; bcc reads both, as build and source.
    common="$(echo "$hdr" | sed 's/-amd64$/-common/')"
    [ -d "$common" ] || common="$hdr"
    mkdir -p "$moddir"
    ln -sfn "$hdr" "$moddir/build"
    ln -sfn "$common" "$moddir/source"
    say "linked $moddir/build -> $hdr, source -> $common"
fi

if [ ! -e /sys/kernel/tracing/events ]; then
    mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null \
        && say "mounted tracefs at /sys/kernel/tracing" \
        || say "could not mount tracefs (tracepoints unavailable)"
fi
if [ ! -e /sys/kernel/debug/tracing ] && [ -d /sys/kernel/debug ]; then
    mount -t debugfs nodev /sys/kernel/debug 2>/dev/null || true
fi

if /usr/bin/python3 -c 'import bcc' 2>/dev/null; then
    say "ok: bcc importable, headers at $(readlink -f "$moddir/build")"
else
    say "bcc still not importable from /usr/bin/python3"
fi
exit 0

#!/bin/sh
# Quickstart: set up fleettop in ./.venv (once) and open the UI on the demo fleet.
#   ./run.sh                  → fleettop fleet.yaml
#   ./run.sh run --headless fleet.yaml --for 30s   (any fleettop arguments)
set -eu
cd "$(dirname "$0")"
. ./.ci/venv.sh
ensure_venv ""
[ $# -gt 0 ] || set -- fleet.yaml
exec .venv/bin/fleettop "$@"

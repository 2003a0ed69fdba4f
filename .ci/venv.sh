# Shared by run.sh and test.sh: a venv in ./.venv with fleettop installed (editable).
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    for cand in python3.11 python3; do
        if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
            PY="$cand"; break
        fi
    done
fi
[ -n "$PY" ] || { echo "fleettop needs Python 3.11 (set PYTHON=/path/to/python3.11)" >&2; exit 1; }

ensure_venv() {
    extras="$1"
    if [ ! -x .venv/bin/python ]; then
        if ! "$PY" -m venv .venv 2>/dev/null; then
            rm -rf .venv
            if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
                apt-get -o DPkg::Lock::Timeout=300 install -y -q python3-venv </dev/null >/dev/null || true
            fi
            "$PY" -m venv .venv || { echo "cannot create a venv: install python3-venv" >&2; exit 1; }
        fi
        .venv/bin/python -m pip install -q --upgrade pip
    fi
    stamp=".venv/.fleettop-installed$extras"
    if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
        .venv/bin/python -m pip install -q -e ".$extras"
        touch "$stamp"
    fi
}

#!/usr/bin/env bash
# RadixView (PyPI `radixview`, a web page drawing a live SGLang-style cache as a radix tree from its
# ZMQ KV events) in its own venv, to check that it attaches to `kvplay serve` by URL (tests marked
# `radixview`).
#   scripts/radixview-setup.sh         create the venv (idempotent; ~30 MB)
#   scripts/radixview-setup.sh path    print the venv's python
# Env: KVPLAY_RADIXVIEW_VENV (default ${XDG_CACHE_HOME:-~/.cache}/kvplay/radixview-venv), KVPLAY_RADIXVIEW (default radixview==0.1.0).
# RadixView's page binds every interface: run it with its host set to 127.0.0.1 (the test sets
# radixview.server._HOST before starting it).
set -euo pipefail
VENV=${KVPLAY_RADIXVIEW_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvplay/radixview-venv}
PIN=${KVPLAY_RADIXVIEW:-radixview==0.1.0}
PY=${PYTHON:-python3}
stamp="$VENV/.kvplay-radixview-setup"
if [ "${1:-setup}" = path ]; then echo "$VENV/bin/python"; exit 0; fi
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$PIN" ] && [ -x "$VENV/bin/python" ]; then
  echo "radixview-setup.sh: $VENV is set up ($PIN)" >&2
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
echo "radixview-setup.sh: installing $PIN into $VENV" >&2
"$VENV/bin/python" -m pip install -q "$PIN"
"$VENV/bin/python" -c "import radixview.server"
echo "$PIN" > "$stamp"
echo "radixview-setup.sh: done" >&2

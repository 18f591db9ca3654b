#!/usr/bin/env bash
# NVIDIA Dynamo's standalone KV indexer (`python -m dynamo.indexer`) in its own venv, to check that
# `kvplay serve`'s KV events are read by the ecosystem's tools (tests marked `dynamo`).
#   scripts/dynamo-setup.sh            create the venv (idempotent; ~275 MB)
#   scripts/dynamo-setup.sh path       print the venv's python
# Env: KVPLAY_DYNAMO_VENV (default ${XDG_CACHE_HOME:-~/.cache}/kvplay/dynamo-venv), KVPLAY_DYNAMO (default ai-dynamo-runtime==1.6.1).
# Only the runtime is needed: the indexer subscribes to ZMQ KV events and answers /query over HTTP;
# no etcd, NATS or GPU. (The full `ai-dynamo` package needs --no-deps here: its `aisimulate`
# dependency is a stub that downloads from elsewhere.) Run the indexer on 127.0.0.1 only.
set -euo pipefail
VENV=${KVPLAY_DYNAMO_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvplay/dynamo-venv}
PIN=${KVPLAY_DYNAMO:-ai-dynamo-runtime==1.6.1}
PY=${PYTHON:-python3}
stamp="$VENV/.kvplay-dynamo-setup"
if [ "${1:-setup}" = path ]; then echo "$VENV/bin/python"; exit 0; fi
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$PIN" ] && [ -x "$VENV/bin/python" ]; then
  echo "dynamo-setup.sh: $VENV is set up ($PIN)" >&2
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
echo "dynamo-setup.sh: installing $PIN into $VENV" >&2
"$VENV/bin/python" -m pip install -q "$PIN"
"$VENV/bin/python" -c "import dynamo.indexer" 2>/dev/null || "$VENV/bin/python" -m dynamo.indexer --help >/dev/null
echo "$PIN" > "$stamp"
echo "dynamo-setup.sh: done: $VENV/bin/python -m dynamo.indexer --help" >&2

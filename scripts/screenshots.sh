#!/usr/bin/env bash
# Regenerate the committed screenshots in screenshots/ with the embedded model (real text).
#   scripts/screenshots.sh            # all of them
# Each one plays a script headless in the real app (`kvplay screenshot`) and saves an SVG.
set -euo pipefail
cd "$(dirname "$0")/.."
KVPLAY=${KVPLAY:-kvplay}
SIZE=${SIZE:-160x48}
"$KVPLAY" screenshot screenshots/three_users.svg --script screenshots/three_users.toml \
    --model default --size "$SIZE" --select-block 3 --title "three users, one shared system prompt"
"$KVPLAY" screenshot screenshots/tree.svg --script screenshots/three_users.toml \
    --model default --size 120x32 --tree --title "the prefix tree: one shared system prompt, a branch per user"
"$KVPLAY" screenshot screenshots/isolation.svg --script screenshots/isolation.toml \
    --model default --size "$SIZE" --title "isolation = user: no sharing across users"
"$KVPLAY" screenshot screenshots/eviction.svg --script screenshots/eviction.toml \
    --model default --size "$SIZE" --show-events --title "eviction pressure: 24 blocks, four users"
# the scrubber: record the eviction-pressure run, then open it at event 40 (mid-run, four users queued)
DB=$(mktemp -d)/scrub.db
"$KVPLAY" run examples/eviction-pressure.toml --model default --db "$DB" --json > /dev/null
SID=$("$KVPLAY" sessions --db "$DB" --json | head -1 | python3 -c 'import json, sys; print(json.load(sys.stdin)["id"])')
"$KVPLAY" scrub "$SID" --db "$DB" --at 40 --screenshot screenshots/scrubber.svg --size "$SIZE"
# attach: the playground on a kvplay server over HTTP and its KV events (what it does for vLLM)
"$KVPLAY" serve --port 18431 --cache-mb 32 --no-record --kv-events-config \
    '{"enable_kv_cache_events": true, "endpoint": "tcp://*:18457", "replay_endpoint": "tcp://*:18458", "topic": "kv-events"}' &
SERVE=$!
trap 'kill $SERVE 2>/dev/null || true' EXIT
for _ in $(seq 120); do curl -sf http://127.0.0.1:18431/health > /dev/null && break; sleep 0.5; done
"$KVPLAY" attach http://127.0.0.1:18431 --events tcp://127.0.0.1:18457 --replay tcp://127.0.0.1:18458 \
    --topic kv-events --pod kvplay-serve --script screenshots/three_users.toml --speed 0 \
    --screenshot screenshots/attach.svg --no-record
kill $SERVE
echo "screenshots/*.svg regenerated"

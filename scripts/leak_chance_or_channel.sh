#!/usr/bin/env bash
# Is the leak lab's signal under per-user isolation chance or a channel? (docs/labs.md, "leak")
#
# Per-user isolation, 1 and 4 shared blocks, 102 hit + 102 miss probes per row over 3 seeds (AUC
# interval about ± 0.08), hit and miss probes interleaved in a shuffled order, and an A/A control
# row per setting: the same procedure with "hit" probes unrelated to the victim's prompt (same
# length). A content channel shows as an isolated AUC whose interval excludes 0.5 while its
# control's does not; chance shows as both within 0.5 ± 0.15; drift/order shows in both.
#
#   scripts/leak_chance_or_channel.sh OUT_DIR [SEED] [extra kvplay lab flags, e.g. --model tiny:llama]
#
# Writes OUT_DIR/leak-seedSEED.json (the lab's JSON) and OUT_DIR/loadavg-seedSEED.txt (/proc/loadavg
# every 10 s while it runs: report it with the figures).
set -euo pipefail
out=${1:?usage: $0 OUT_DIR [SEED] [kvplay lab flags]}
seed=${2:-0}
shift $(( $# >= 2 ? 2 : 1 ))
mkdir -p "$out"
kvplay=${KVPLAY:-kvplay}
( while sleep 10; do echo "$(date -u +%H:%M:%S) $(cat /proc/loadavg)"; done ) > "$out/loadavg-seed$seed.txt" &
sampler=$!
trap 'kill $sampler' EXIT
echo "$(date -u +%H:%M:%S) $(cat /proc/loadavg)" >> "$out/loadavg-seed$seed.txt"
"$kvplay" lab leak --isolations user --blocks 1,4 --control --mitigations none --seed "$seed" \
    --no-record --json "$@" > "$out/leak-seed$seed.json"
echo "$(date -u +%H:%M:%S) $(cat /proc/loadavg)" >> "$out/loadavg-seed$seed.txt"

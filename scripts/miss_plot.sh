#!/usr/bin/env bash
# Regenerate docs/miss.png, the picture in docs/miss.md: play examples/cache-breaker.toml on the
# embedded model into a throwaway sessions DB, then `kvplay explain` it with --plot.
#   scripts/miss_plot.sh            (about a minute on a 2-core CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVPLAY_VENV:-.venv}
db=$(mktemp -d)/sessions.db
trap 'rm -rf "$(dirname "$db")"' EXIT
"$VENV/bin/kvplay" run examples/cache-breaker.toml --db "$db" --threads 1
sid=$("$VENV/bin/python" -c "import sqlite3, sys; print(sqlite3.connect(sys.argv[1]).execute('select id from sessions').fetchone()[0])" "$db")
"$VENV/bin/kvplay" explain "$sid" --db "$db" --plot docs/miss.png

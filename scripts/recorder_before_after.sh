#!/usr/bin/env bash
# Recording throughput before and after, in one run: `mirror_bench --record` (decode + apply +
# record a synthetic vLLM-like stream to SQLite, one thread) on a git ref's code (default main),
# then on the working tree. The ref's package is staged as Python sees it (as
# scripts/lint_imports.sh stages it) and put ahead of the editable install on PYTHONPATH.
#   scripts/recorder_before_after.sh [REF] [--events N]
set -euo pipefail
cd "$(dirname "$0")/.."
REF=${1:-main}
shift || true
PY=${KVPLAY_VENV:-.venv}/bin/python
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir "$stage/src"
git archive "$REF" | tar -x -C "$stage/src"
mkdir "$stage/kvplay"
cp "$stage/src/kvplay/"*.py "$stage/kvplay/"
for folder in engine wire sessions serve tui labs bench; do
  mkdir "$stage/kvplay/$folder"
  cp "$stage/src/$folder/"*.py "$stage/kvplay/$folder/"
done
echo "before ($REF, $(git rev-parse --short "$REF")):"
PYTHONPATH="$stage" "$PY" -m kvplay.bench.mirror_bench --record --no-socket "$@"
echo "after (working tree, $(git rev-parse --short HEAD)$(git diff --quiet || echo ' + changes')):"
"$PY" -m kvplay.bench.mirror_bench --record --no-socket "$@"

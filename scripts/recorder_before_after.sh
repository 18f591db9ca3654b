#!/usr/bin/env bash
# Recording throughput before and after, in one run: this checkout's `mirror_bench --record`
# (decode + apply + record a synthetic vLLM-like stream to SQLite, one thread; and the recorder
# alone) on a git ref's package (default main), then on the working tree. The ref's package is staged as Python sees it (as
# scripts/lint_imports.sh stages it) and put ahead of the editable install on PYTHONPATH.
#   scripts/recorder_before_after.sh [REF] [--events N]
set -euo pipefail
cd "$(dirname "$0")/.."
REF=${1:-main}
shift || true
PY=$(cd "${KVPLAY_VENV:-.venv}/bin" && pwd)/python
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
# This checkout's bench (so both runs measure the same way) on the ref's package, run from the
# stage: with the checkout as the working directory its kvplay/ would come first.
bench=$(pwd)/bench/mirror_bench.py
(cd "$stage" && PYTHONPATH="$stage" "$PY" "$bench" --record --no-socket "$@")
echo "after (working tree, $(git rev-parse --short HEAD)$(git diff --quiet || echo ' + changes')):"
"$PY" -m kvplay.bench.mirror_bench --record --no-socket "$@"

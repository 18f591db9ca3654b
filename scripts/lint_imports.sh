#!/usr/bin/env bash
# Check the layers declared in pyproject.toml ([tool.importlinter]) with import-linter.
#
# pyproject.toml maps each top-level folder to kvplay.<folder> (package-dir), and the editable
# install resolves that mapping with an import hook; grimp (import-linter's graph builder) walks
# the package's folder on disk instead, so from a checkout it would see only kvplay/. This stages
# a copy of the package as Python sees it (kvplay/ with engine/, wire/, … inside, .py files only)
# in a temporary directory and points lint-imports at it. Exit status: lint-imports' own (1 when
# a contract is broken).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVPLAY_VENV:-.venv}
LINT=$(cd "$VENV/bin" && pwd)/lint-imports
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir "$stage/kvplay"
cp kvplay/*.py "$stage/kvplay/"
mkdir "$stage/kvplay/commands"
cp kvplay/commands/*.py "$stage/kvplay/commands/"
for folder in engine wire sessions serve tui labs bench; do
  mkdir "$stage/kvplay/$folder"
  cp "$folder"/*.py "$stage/kvplay/$folder/"
done
cp pyproject.toml "$stage/"
# PYTHONPATH puts the staged copy ahead of the editable install's import hook; --no-cache:
# the stage is new every run.
cd "$stage" && PYTHONPATH="$stage" "$LINT" pyproject.toml --no-cache --no-logo "$@"

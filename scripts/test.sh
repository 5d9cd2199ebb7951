#!/usr/bin/env bash
# The whole test suite: lint, format check, strict typing, then pytest.
# Integration tests start their own redis-server on a free port; nothing here
# touches a Redis you already run.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
export PATH="$PWD/.venv/bin:$PATH"
echo "== ruff"
# one command per line: under set -e a failure on the left of && does not stop the script
ruff check .
ruff format --check .
echo "== mypy"; mypy services tests bench scripts
echo "== pytest"; pytest -q "$@"

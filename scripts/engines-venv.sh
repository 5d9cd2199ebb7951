#!/usr/bin/env bash
# Installs the pinned real-engine stack (vLLM CPU build, NIXL, the peer router) into a
# virtualenv of its own, cached by the hash of its pins under ~/.cache/hetero-pd/engines
# (HPD_ENGINES_CACHE overrides), and prints its path. The pins and the install steps live
# in services/tools/hpd_fleet/real_install.py; a second run with the same pins returns at once.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh >&2
exec .venv/bin/python -m hpd_fleet.real venv

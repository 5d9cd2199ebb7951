#!/usr/bin/env bash
# Puts a `promtool` binary (Prometheus's own rule checker and rule unit-test runner) into
# .venv/bin, for tests/unit/deploy and `promtool test rules deploy/prometheus/rules_test.yaml`.
# Does nothing when .venv/bin/promtool is already there.
#
# First choice: Debian's `prometheus` package, downloaded (not installed: no daemon is set
# up or started) and unpacked into a temporary folder, from which only usr/bin/promtool is
# copied. Otherwise: the official release tarball, checked against the release's
# sha256sums.txt. PROMTOOL_VERSION picks the release (default below).
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.venv/bin/promtool
if [ -x "$dest" ]; then
  exit 0
fi
mkdir -p .venv/bin
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

from_apt() {
  command -v apt-get >/dev/null && command -v dpkg >/dev/null || return 1
  # apt fetches as the unprivileged _apt user where it can: let it write here
  chmod 0777 "$tmp"
  (cd "$tmp" && apt-get download -q prometheus) >/dev/null 2>&1 || return 1
  local debs=("$tmp"/prometheus_*.deb)
  [ -f "${debs[0]}" ] || return 1
  dpkg -x "${debs[0]}" "$tmp/root" || return 1
  [ -x "$tmp/root/usr/bin/promtool" ] || return 1
  install -m 0755 "$tmp/root/usr/bin/promtool" "$dest"
}

from_release() {
  local version=${PROMTOOL_VERSION:-2.53.4}
  local arch
  case "$(uname -m)" in
    x86_64 | amd64) arch=amd64 ;;
    aarch64 | arm64) arch=arm64 ;;
    *) return 1 ;;
  esac
  local os
  os=$(uname -s | tr '[:upper:]' '[:lower:]')
  local name="prometheus-${version}.${os}-${arch}"
  local base="https://github.com/prometheus/prometheus/releases/download/v${version}"
  command -v curl >/dev/null || return 1
  curl -fsSL --retry 3 -o "$tmp/$name.tar.gz" "$base/$name.tar.gz" || return 1
  curl -fsSL --retry 3 -o "$tmp/sha256sums.txt" "$base/sha256sums.txt" || return 1
  (cd "$tmp" && grep " $name.tar.gz\$" sha256sums.txt | sha256sum -c --quiet -) || return 1
  tar -xzf "$tmp/$name.tar.gz" -C "$tmp" "$name/promtool" || return 1
  install -m 0755 "$tmp/$name/promtool" "$dest"
}

if from_apt || from_release; then
  echo "promtool: $("$dest" --version 2>&1 | head -n 1)"
else
  echo "warning: could not fetch promtool (apt-get download prometheus, or the release" \
    "tarball); the alert rule tests will be skipped (they fail under CI=true)" >&2
  exit 1
fi

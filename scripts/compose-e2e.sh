#!/usr/bin/env bash
# End-to-end suite against the compose stack (compose.yaml), from nothing:
#
#   1. container tooling: Docker with its compose plugin when a Docker engine answers;
#      otherwise rootful podman from Debian's packages (installed if missing) and
#      podman-compose in a venv of its own, with private podman config and storage;
#   2. a base image without pulling anything (podman only): debootstrap a minimal
#      Debian bookworm (Python 3.11 + redis-server) and import it; cached once built;
#   3. a wheelhouse of the package and its dependencies (so the image build is offline),
#      then the image;
#   4. the stack up with free host ports on 127.0.0.1, waiting on gRPC health;
#   5. the certificates from the stack's own `certs` service, then pytest (-v, so every
#      test that ran is named) over the shared component tests, pointed at the stack by
#      HPD_*_ADDR, plus tests/compose (grpcurl, Redis restart, network partition, registry
#      kill, the fleet replay), on the stack in plaintext (tests/compose/compose.e2e.yaml:
#      those tests are written for anonymous callers of every role);
#   6. the stack as shipped (compose.yaml alone: mutual TLS, certificate identities), the
#      certificates kept, not made anew, with its gateway and the `fleet` profile's emulated
#      engines behind it, and tests/compose/test_tls.py, the fleet replay and
#      tests/compose/test_gateway.py (completions through the gateway's published port)
#      against it (HPD_E2E_TLS=0 skips this phase);
#   7. teardown of the stack and its volume, also on failure or Ctrl-C.
#
# Only the services the image's `hpd` knows are started (`hpd --help` lists them), so
# the scheduler and kvbroker join as soon as their commands exist.
#
# Environment (all optional):
#   HPD_E2E_DIR        scratch folder: podman config, storage (the cached base image),
#                      the podman-compose venv; default ~/.cache/hetero-pd/compose-e2e
#   HPD_E2E_PROJECT    compose project name; default hpd-e2e
#   HPD_E2E_KEEP=1     leave the stack running after the tests (tear down by hand)
#   HPD_E2E_ENGINE     docker or podman (default: docker when its engine answers)
#   HPD_BASE_IMAGE     base image (default: the local debootstrap base with podman,
#                      python:3.11-slim with docker)
#   HPD_E2E_MIRROR     Debian mirror for debootstrap (default: from the apt sources)
#   HPD_E2E_TESTS      test paths; default "tests/component tests/compose"
#   extra arguments    passed to pytest (e.g. -k restart)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
T0=$(date +%s)
step() { printf '\n== [%3ss] %s\n' "$(($(date +%s) - T0))" "$*"; }
die() { echo "compose-e2e: $*" >&2; exit 1; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

WORK=${HPD_E2E_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/hetero-pd/compose-e2e}
PROJECT=${HPD_E2E_PROJECT:-hpd-e2e}
IMAGE=${HPD_IMAGE:-localhost/hetero-pd:e2e}
SUITE=${HPD_E2E_SUITE:-bookworm}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)

# ---- 1. tooling -------------------------------------------------------------------------
ENGINE=${HPD_E2E_ENGINE:-}
if [ -z "$ENGINE" ]; then
  if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1 \
    && docker compose version >/dev/null 2>&1; then
    ENGINE=docker
  else
    ENGINE=podman
  fi
fi

step "tooling ($ENGINE)"
if [ "$ENGINE" = podman ]; then
  APT_PKGS=(podman runc crun netavark aardvark-dns slirp4netns fuse-overlayfs
    containernetworking-plugins debootstrap uidmap iptables catatonit)
  missing=()
  for pkg in "${APT_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' \
      || missing+=("$pkg")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "installing: ${missing[*]}"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      --no-install-recommends "${missing[@]}" >/dev/null
  fi
  if [ ! -x "$WORK/venv/bin/podman-compose" ]; then
    python3 -m venv "$WORK/venv"
    "$WORK/venv/bin/pip" install -q 'podman-compose==1.6.0'
  fi
  COMPOSE=("$WORK/venv/bin/podman-compose")

  # Private podman configuration and storage: nothing of the machine's own is touched.
  # nofile/nproc: the sandbox cannot raise limits to podman's defaults; runc: crun
  # refuses hybrid cgroups; cgroupfs and file events: there is no systemd.
  mkdir -p "$WORK/storage/root" "$WORK/storage/run" "$WORK/networks" "$WORK/tmp"
  cat >"$WORK/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
log_driver = "k8s-file"

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "$WORK/storage/events.log"
tmp_dir = "$WORK/tmp"

[network]
network_backend = "netavark"
network_config_dir = "$WORK/networks"
EOF
  cat >"$WORK/storage.conf" <<EOF
[storage]
driver = "overlay"
graphroot = "$WORK/storage/root"
runroot = "$WORK/storage/run"
EOF
  export CONTAINERS_CONF="$WORK/containers.conf"
  export CONTAINERS_STORAGE_CONF="$WORK/storage.conf"
  ENG=(as_root env CONTAINERS_CONF="$CONTAINERS_CONF"
    CONTAINERS_STORAGE_CONF="$CONTAINERS_STORAGE_CONF" podman)
  [ "$(id -u)" = 0 ] || COMPOSE=(as_root env CONTAINERS_CONF="$CONTAINERS_CONF"
    CONTAINERS_STORAGE_CONF="$CONTAINERS_STORAGE_CONF" "${COMPOSE[@]}")
  "${ENG[@]}" --version
  "${COMPOSE[@]}" --version 2>/dev/null | tail -n 1
  BASE_IMAGE=${HPD_BASE_IMAGE:-localhost/hpd-base:$SUITE}
  NOHC=(--no-healthcheck)  # one-off runs: no systemd to schedule the image's check
else
  ENG=(docker)
  COMPOSE=(docker compose)
  BASE_IMAGE=${HPD_BASE_IMAGE:-python:3.11-slim}
  NOHC=(--no-healthcheck)
fi
scripts/bootstrap.sh
[ -x .venv/bin/grpcurl ] || die "grpcurl is missing (scripts/bootstrap.sh could not fetch it)"

# ---- 2. base image ----------------------------------------------------------------------
if [ "$ENGINE" = podman ] && ! "${ENG[@]}" image exists "$BASE_IMAGE"; then
  step "base image $BASE_IMAGE (debootstrap $SUITE)"
  mirror=${HPD_E2E_MIRROR:-}
  if [ -z "$mirror" ]; then
    mirror=$(sed -n 's/^URIs:[[:space:]]*\([^[:space:]]*\).*/\1/p' \
      /etc/apt/sources.list.d/*.sources 2>/dev/null | grep -v -- '-security' | head -n 1 || true)
  fi
  if [ -z "$mirror" ]; then
    mirror=$(sed -n 's/^deb[[:space:]]\+\(\[[^]]*\][[:space:]]\+\)\?\([^[:space:]]*\).*/\2/p' \
      /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
      | grep -v -- '-security' | head -n 1 || true)
  fi
  mirror=${mirror:-http://deb.debian.org/debian}
  echo "mirror: $mirror"
  rootfs="$WORK/rootfs"
  as_root rm -rf "$rootfs"
  as_root debootstrap --variant=minbase \
    --include=python3,python3-venv,redis-server,passwd,ca-certificates \
    "$SUITE" "$rootfs" "$mirror" >"$WORK/debootstrap.log" 2>&1 \
    || { tail -n 30 "$WORK/debootstrap.log" >&2; die "debootstrap failed"; }
  as_root rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
    "$rootfs"/usr/share/doc "$rootfs"/usr/share/man "$rootfs"/usr/share/locale
  as_root tar -C "$rootfs" -c . | "${ENG[@]}" import --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE"
  as_root rm -rf "$rootfs"
fi

# ---- 3. wheelhouse and image --------------------------------------------------------------
step "wheelhouse"
mkdir -p wheelhouse
rm -f wheelhouse/hetero_pd-*.whl
# A fixed SOURCE_DATE_EPOCH makes the wheel byte-identical for identical sources, so an
# unchanged tree hits the image build's layer cache.
SOURCE_DATE_EPOCH=315532800 .venv/bin/pip wheel -q --find-links wheelhouse -w wheelhouse . \
  >"$WORK/wheel.log" 2>&1 \
  || { tail -n 30 "$WORK/wheel.log" >&2; die "building the wheelhouse failed"; }
# pip resolves environment markers for the host's Python (3.11.7 here), the image may run
# another patch release (bookworm: 3.11.2, which needs async-timeout for redis). Walk the
# wheels' Requires-Dist with the image's own marker environment and add what is missing.
target_env=$("${ENG[@]}" run --rm "${NOHC[@]}" "$BASE_IMAGE" python3 -c '
import json, os, platform, sys
impl = sys.implementation
v = impl.version
iv = f"{v.major}.{v.minor}.{v.micro}" + ("" if v.releaselevel == "final" else v.releaselevel[0] + str(v.serial))
print(json.dumps({"implementation_name": impl.name, "implementation_version": iv,
  "os_name": os.name, "platform_machine": platform.machine(),
  "platform_release": platform.release(), "platform_system": platform.system(),
  "platform_version": platform.version(), "python_full_version": platform.python_version(),
  "platform_python_implementation": platform.python_implementation(),
  "python_version": ".".join(platform.python_version_tuple()[:2]), "sys_platform": sys.platform}))')
for _ in 1 2 3 4; do
  need=$(TARGET_ENV="$target_env" .venv/bin/python - wheelhouse <<'EOF'
import json, os, sys, zipfile
from pathlib import Path
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

env = json.loads(os.environ["TARGET_ENV"])
wheels = {parse_wheel_filename(p.name)[0]: p for p in Path(sys.argv[1]).glob("*.whl")}
def requires(path):
    with zipfile.ZipFile(path) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode()
    return [Requirement(line.split(":", 1)[1].strip()) for line in text.splitlines()
            if line.startswith("Requires-Dist:")]
todo, seen, missing = [(canonicalize_name("hetero-pd"), frozenset())], set(), set()
while todo:
    name, extras = todo.pop()
    if (name, extras) in seen:
        continue
    seen.add((name, extras))
    if name not in wheels:
        continue
    for req in requires(wheels[name]):
        if req.marker is not None and not any(
            req.marker.evaluate({**env, "extra": e}) for e in (extras or {""})
        ):
            continue
        dep = canonicalize_name(req.name)
        if dep in wheels:
            todo.append((dep, frozenset(req.extras)))
        else:
            req.marker = None
            missing.add(str(req))
print("\n".join(sorted(missing)))
EOF
)
  [ -n "$need" ] || break
  echo "for the image's Python: $(tr '\n' ' ' <<<"$need")"
  mapfile -t need_list <<<"$need"
  .venv/bin/pip wheel -q --find-links wheelhouse -w wheelhouse "${need_list[@]}" >>"$WORK/wheel.log" 2>&1 \
    || { tail -n 30 "$WORK/wheel.log" >&2; die "completing the wheelhouse failed"; }
done
ls wheelhouse/hetero_pd-*.whl >/dev/null || die "building the wheelhouse failed"

step "image $IMAGE from $BASE_IMAGE"
if [ "$ENGINE" = podman ]; then
  "${ENG[@]}" build -q --format docker --build-arg BASE_IMAGE="$BASE_IMAGE" \
    -t "$IMAGE" -f Dockerfile .
else
  "${ENG[@]}" build -q --build-arg BASE_IMAGE="$BASE_IMAGE" -t "$IMAGE" -f Dockerfile .
fi

# Old builds' dangling images go; the last half hour's stay as the layer cache.
"${ENG[@]}" image prune -f --filter until=30m >/dev/null 2>&1 || true

# Services the image can run: the compose services whose `hpd` command exists.
commands=$("${ENG[@]}" run --rm "${NOHC[@]}" "$IMAGE" hpd --help)
SERVICES=(registry scheduler kvbroker)
UP=()
for svc in "${SERVICES[@]}"; do
  if grep -q -E "^  $svc " <<<"$commands"; then UP+=("$svc"); fi
done
[ ${#UP[@]} -gt 0 ] || die "the image knows none of: ${SERVICES[*]}"
echo "services: ${UP[*]}"

# ---- 4. stack up --------------------------------------------------------------------------
# Free host ports on 127.0.0.1, so the stack never collides with anything already running.
read -r -a PORTS <<<"$(python3 - <<'EOF'
import socket
socks = [socket.socket() for _ in range(8)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
for s in socks:
    s.close()
EOF
)"
export HPD_IMAGE=$IMAGE HPD_BASE_IMAGE=$BASE_IMAGE HPD_BIND=127.0.0.1
export HPD_REGISTRY_PORT=${PORTS[0]} HPD_SCHEDULER_PORT=${PORTS[1]} HPD_KVBROKER_PORT=${PORTS[2]}
export HPD_REGISTRY_METRICS_PORT=${PORTS[3]} HPD_SCHEDULER_METRICS_PORT=${PORTS[4]}
export HPD_KVBROKER_METRICS_PORT=${PORTS[5]}
export HPD_GATEWAY_PORT=${PORTS[6]} HPD_GATEWAY_METRICS_PORT=${PORTS[7]}
compose() {
  "${COMPOSE[@]}" -p "$PROJECT" -f "$ROOT/compose.yaml" -f "$ROOT/tests/compose/compose.e2e.yaml" "$@"
}

teardown() {
  local rc=$?
  trap - EXIT INT TERM
  if [ "$rc" != 0 ]; then
    step "failed (exit $rc): last log lines of the stack"
    compose logs >"$WORK/stack.log" 2>&1 || true
    # every failed RPC the services logged (INTERNAL is logged with its traceback), then the tail
    grep -E '"rpc_failed"|Traceback|Error:' "$WORK/stack.log" | tail -n 60 || true
    tail -n 80 "$WORK/stack.log" || true
  fi
  if [ "${HPD_E2E_KEEP:-0}" = 1 ]; then
    step "stack left running (HPD_E2E_KEEP=1); to remove it:"
    [ "$ENGINE" = podman ] && echo "  export CONTAINERS_CONF=$CONTAINERS_CONF" \
      "CONTAINERS_STORAGE_CONF=$CONTAINERS_STORAGE_CONF"
    echo "  ${COMPOSE[*]} -p $PROJECT -f $ROOT/compose.yaml down -v"
  else
    step "teardown"
    compose down -v -t 5 >/dev/null 2>&1 || true
    # podman-compose leaves the network when a container was disconnected by a test.
    if [ "$ENGINE" = podman ]; then
      "${ENG[@]}" network rm -f "${PROJECT}_default" >/dev/null 2>&1 || true
      "${ENG[@]}" volume rm -f "${PROJECT}_redis-data" >/dev/null 2>&1 || true
    fi
  fi
  step "done: exit $rc after $(($(date +%s) - T0)) s"
  exit "$rc"
}
trap teardown EXIT
trap 'exit 130' INT TERM

step "certificates: the stack's certs service"
compose down -v -t 2 >/dev/null 2>&1 || true
TLS_DIR="$WORK/tls"
as_root rm -rf "$TLS_DIR"
mkdir -p "$TLS_DIR"
export HPD_TLS_DIR=$TLS_DIR
certs_up() {  # podman-compose does not wait for a healthy dependency: start certs, wait
  compose up -d certs >>"$WORK/certs.log" 2>&1 || { cat "$WORK/certs.log"; die "certs failed"; }
  for _ in $(seq 1 120); do
    compose exec -T certs test -f /tmp/certs-ready >/dev/null 2>&1 && return 0
    sleep 0.5
  done
  compose logs certs 2>&1 | tail -n 20
  die "the certs service wrote no certificates within 60 s"
}
certs_up
as_root test -s "$TLS_DIR/role-worker.key" || die "the certs service wrote no role certificates"
as_root sha256sum "$TLS_DIR/ca.pem" >"$WORK/ca.sum"

step "stack up in plaintext (tests/compose/compose.e2e.yaml): redis ${UP[*]}"
compose up -d redis "${UP[@]}" >"$WORK/up.log" 2>&1 || { cat "$WORK/up.log"; die "up failed"; }

declare -A PORT_OF=([registry]=$HPD_REGISTRY_PORT [scheduler]=$HPD_SCHEDULER_PORT
  [kvbroker]=$HPD_KVBROKER_PORT)
for svc in "${UP[@]}"; do
  .venv/bin/python scripts/grpc_health_probe.py --addr "127.0.0.1:${PORT_OF[$svc]}" --wait 90 \
    || die "$svc did not become SERVING"
done

# ---- 5. tests -----------------------------------------------------------------------------
step "tests against the stack"
export HPD_COMPOSE=1 HPD_COMPOSE_ENGINE=$ENGINE HPD_COMPOSE_PROJECT=$PROJECT
export HPD_COMPOSE_SERVICES="${UP[*]}"
for svc in "${UP[@]}"; do
  export "HPD_${svc^^}_ADDR=127.0.0.1:${PORT_OF[$svc]}"
done
set +e
read -r -a TEST_PATHS <<<"${HPD_E2E_TESTS:-tests/component tests/compose}"
.venv/bin/pytest -v -rA -p no:cacheprovider "${TEST_PATHS[@]}" "$@"
rc=$?
set -e
[ "$rc" = 0 ] || exit "$rc"

# ---- 6. the stack as shipped: mutual TLS, certificate identities -------------------------
[ "${HPD_E2E_TLS:-1}" = 1 ] || exit 0
step "the stack as shipped (compose.yaml alone): mutual TLS, the gateway, the fleet profile"
compose down -v -t 2 >/dev/null 2>&1 || true
compose() {  # the profile lets `engines` come up by name and go down with the rest
  "${COMPOSE[@]}" -p "$PROJECT" -f "$ROOT/compose.yaml" --profile fleet "$@"
}
certs_up  # it keeps what it made before
as_root sha256sum -c --quiet "$WORK/ca.sum" || die "the certs service made a new CA over the kept one"
compose up -d redis "${UP[@]}" >"$WORK/up-tls.log" 2>&1 || { cat "$WORK/up-tls.log"; die "up failed"; }
# the host reads the files as root; the probe presents the plain client certificate
for svc in "${UP[@]}"; do
  as_root .venv/bin/python scripts/grpc_health_probe.py --addr "127.0.0.1:${PORT_OF[$svc]}" \
    --wait 90 --ca-file "$TLS_DIR/ca.pem" --cert-file "$TLS_DIR/client.pem" \
    --key-file "$TLS_DIR/client.key" || die "$svc did not become SERVING over TLS"
done
# The gateway (embedded mode: it plans in its own process over the stack's Redis) and the
# emulated engines it serves (profile `fleet`), once the services they call are SERVING.
compose up -d gateway engines >>"$WORK/up-tls.log" 2>&1 \
  || { cat "$WORK/up-tls.log"; die "up of the gateway and engines failed"; }
as_root .venv/bin/python - "https://127.0.0.1:$HPD_GATEWAY_PORT/health" "$TLS_DIR/ca.pem" <<'EOF' \
  || die "the gateway did not answer /health over HTTPS"
import ssl, sys, time, urllib.request
context = ssl.create_default_context(cafile=sys.argv[2])
deadline = time.monotonic() + 90
while True:
    try:
        urllib.request.urlopen(sys.argv[1], timeout=3, context=context).close()
        break
    except OSError as exc:
        if time.monotonic() > deadline:
            sys.exit(f"{sys.argv[1]}: {exc}")
        time.sleep(0.5)
EOF
step "tests against the stack as shipped"
export HPD_COMPOSE_TLS_DIR=$TLS_DIR
set +e
as_root env "PATH=$PATH" "HPD_COMPOSE=1" "HPD_COMPOSE_TLS_DIR=$TLS_DIR" \
  "HPD_COMPOSE_ENGINE=$ENGINE" "HPD_COMPOSE_PROJECT=$PROJECT" \
  "HPD_COMPOSE_SERVICES=${UP[*]} gateway engines" \
  "HPD_REGISTRY_ADDR=$HPD_REGISTRY_ADDR" "HPD_SCHEDULER_ADDR=$HPD_SCHEDULER_ADDR" \
  "HPD_KVBROKER_ADDR=$HPD_KVBROKER_ADDR" "HPD_GATEWAY_ADDR=127.0.0.1:$HPD_GATEWAY_PORT" \
  "HPD_GATEWAY_METRICS_PORT=$HPD_GATEWAY_METRICS_PORT" \
  .venv/bin/pytest -v -rA -p no:cacheprovider tests/compose/test_tls.py \
  tests/compose/test_fleet_replay.py tests/compose/test_gateway.py
rc=$?
set -e
[ "$rc" = 0 ] || exit "$rc"

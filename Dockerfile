# One image for the whole control plane: `hpd registry`, `hpd scheduler`, `hpd kvbroker`
# (pick one with the container's command), plus redis-server for compose.yaml's Redis.
#
#   docker build -t hetero-pd .                                   # public slim Python base
#   podman build --format docker \
#     --build-arg BASE_IMAGE=localhost/hpd-base:bookworm -t hetero-pd .   # a local base
#
# With a wheelhouse/ folder in the build context (`pip wheel . -w wheelhouse`), the
# package and all its dependencies install from it with --no-index: the build then
# needs no network at all. Without one, pip builds the package from the source tree.
# The base must run Python 3.11+ (the wheels in a wheelhouse must match its version).

ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
COPY . /src
RUN set -eu; \
    python3 -m venv /opt/hpd; \
    if ls /src/wheelhouse/hetero_pd-*.whl >/dev/null 2>&1; then \
      /opt/hpd/bin/pip install --no-index --find-links /src/wheelhouse hetero-pd; \
    else \
      /opt/hpd/bin/pip install /src; \
    fi; \
    /opt/hpd/bin/hpd --help >/dev/null; \
    find /opt/hpd -name '__pycache__' -prune -exec rm -rf {} +; \
    /opt/hpd/bin/python -m compileall -q /opt/hpd/lib >/dev/null || true

FROM ${BASE_IMAGE}
# redis-server: already in the local base; installed here on a public base, so compose's
# Redis runs from this same image and the stack needs no other image.
RUN set -eu; \
    if ! command -v redis-server >/dev/null 2>&1; then \
      apt-get update; \
      apt-get install -y --no-install-recommends redis-server; \
      rm -rf /var/lib/apt/lists/*; \
    fi; \
    groupadd --system --gid 10001 hpd; \
    useradd --system --uid 10001 --gid hpd --home-dir /var/lib/hpd --create-home \
      --shell /usr/sbin/nologin hpd; \
    install -d -o hpd -g hpd -m 0750 /data
COPY --from=build /opt/hpd /opt/hpd
COPY scripts/grpc_health_probe.py /usr/local/lib/hpd/grpc_health_probe.py
ENV PATH=/opt/hpd/bin:$PATH \
    VIRTUAL_ENV=/opt/hpd \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HPD_HOST=0.0.0.0 \
    HPD_JSON_LOGS=true
USER hpd
WORKDIR /var/lib/hpd
EXPOSE 50051 50052 50053
# Health over grpc.health.v1 on 127.0.0.1:$HPD_PORT (the port the service listens on).
# Compose sets a check per service as well; Docker runs this one when none is set.
HEALTHCHECK --interval=10s --timeout=4s --start-period=20s --retries=3 \
  CMD ["/opt/hpd/bin/python", "/usr/local/lib/hpd/grpc_health_probe.py"]
CMD ["hpd", "--help"]

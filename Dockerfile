# syntax=docker/dockerfile:1
#
# The avest sidecar: `avest serve` (gRPC + admin HTTP) and nothing else — no
# torch, no vLLM. Build from the repository root:
#
#   docker build -t avest:local .
#   docker run --rm -p 127.0.0.1:50051:50051 -p 127.0.0.1:50052:50052 -p 127.0.0.1:8000:8000 \
#     -v avest-data:/data \
#     -e AVEST_WORKER_TOKEN=... -e AVEST_ADMIN_TOKEN=... avest:local
#
# The container listens on all its interfaces, so the service needs a worker
# token there (or --insecure); without an admin token, admin actions are refused.
#
# Ports: 50051 gRPC (avest.v1.EstimatorService, health, reflection);
#        50052  the read port (GetCoefficients, Score, Budget and health, answered while Observe
#               streams keep 50051 busy);
#        8000   admin HTTP (/healthz, /readyz, /metrics, /v1/pairs, /docs).
# Settings: every `avest serve` flag is also an AVEST_* environment variable
# (`docker run --rm avest:local --help` lists them); the addresses and the
# data directory are set below for a container.

# The base image, pinned by digest so that a rebuild starts from the same bytes:
# python:3.11.14-slim-bookworm (the multi-platform index). To move to a newer
# Python 3.11 slim, take the digest of the tag you want (`docker buildx
# imagetools inspect python:3.11-slim`) and change both the tag here and the
# digest.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm@sha256:65a93d69fa75478d554f4ad27c85c1e69fa184956261b4301ebaf6dbb0a3543d

# -- build: the server's dependencies, then the package, into a venv
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# 1. Dependencies, at the exact versions of deploy/constraints.txt (the lock
#    `uv pip compile` writes for '.[server]'; its header is the command). This
#    layer changes only with that file, so source edits do not reinstall them.
COPY deploy/constraints.txt deploy/constraints.txt
RUN python -m venv /opt/avest \
 && /opt/avest/bin/pip install --no-cache-dir --requirement deploy/constraints.txt
# 2. The package itself, without touching the dependencies; `pip check` fails
#    the build if the constraints miss one.
COPY pyproject.toml README.md LICENSE ./
COPY service/ service/
COPY client/ client/
COPY wire/ wire/
RUN /opt/avest/bin/pip install --no-cache-dir --no-deps --constraint deploy/constraints.txt ".[server]" \
 && /opt/avest/bin/pip check \
 && /opt/avest/bin/avest --version

# -- runtime: the venv on a fresh slim image, run as an unprivileged user
FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="avest" \
      org.opencontainers.image.description="Acceptance-estimator sidecar for speculative decoding in vLLM" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 avest \
 && useradd --system --uid 10001 --gid avest --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin avest \
 && mkdir -p /data \
 && chown avest:avest /data
COPY --from=build /opt/avest /opt/avest
ENV PATH=/opt/avest/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    AVEST_GRPC_ADDRESS=0.0.0.0:50051 \
    AVEST_READ_ADDRESS=0.0.0.0:50052 \
    AVEST_HTTP_ADDRESS=0.0.0.0:8000 \
    AVEST_DATA_DIR=/data
# The SQLite database (pairs, coefficient history, calibration, cost curves).
VOLUME ["/data"]
# 50051: gRPC; 50052: the read port; 8000: admin HTTP and Prometheus /metrics.
EXPOSE 50051 50052 8000
USER 10001:10001
WORKDIR /data
# Liveness over the admin HTTP port (/healthz), with the service's own settings:
# AVEST_HTTP_ADDRESS, and HTTPS (client certificate included) when AVEST_TLS_* is set.
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
    CMD ["avest", "health"]
ENTRYPOINT ["avest", "serve"]

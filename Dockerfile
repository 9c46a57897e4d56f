# syntax=docker/dockerfile:1.7
# ddpbus images. CPU (default target):   docker build -t ddpbus:0.1.0-cpu --target cpu .
#                GPU (CUDA runtime):      docker build -t ddpbus:0.1.0 --target gpu .
# Both install ddpbus with the pinned constraints, ship the digits example at
# /opt/ddpbus/examples, run as the non-root user 10001 and start `ddpbus`.

FROM python:3.11.11-slim-bookworm AS cpu
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY codecs/ codecs/
COPY orchestrator/ orchestrator/
COPY worker_agent/ worker_agent/
# the CPU build of the pinned torch (the default index would pull the CUDA one)
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu \
        -c constraints.txt ".[examples]" \
    && useradd --uid 10001 --create-home --shell /usr/sbin/nologin ddpbus
COPY examples/ /opt/ddpbus/examples/
USER 10001:10001
WORKDIR /home/ddpbus
ENTRYPOINT ["ddpbus"]
CMD ["--help"]

FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 AS gpu
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY codecs/ codecs/
COPY orchestrator/ orchestrator/
COPY worker_agent/ worker_agent/
RUN pip install -c constraints.txt ".[examples]" \
    && useradd --uid 10001 --create-home --shell /usr/sbin/nologin ddpbus
COPY examples/ /opt/ddpbus/examples/
USER 10001:10001
WORKDIR /home/ddpbus
ENTRYPOINT ["ddpbus"]
CMD ["--help"]

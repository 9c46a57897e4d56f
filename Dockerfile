# syntax=docker/dockerfile:1.7
# ddpbus images: one recipe, two bases.
#   CPU (default):     docker build -t ghcr.io/ddpbus/ddpbus:0.1.0-cpu .
#   GPU (CUDA 12.8):   docker build -t ghcr.io/ddpbus/ddpbus:0.1.0 --build-arg FLAVOR=gpu .
# Both install ddpbus under the lock's pins (requirements/constraints.txt: torch from the
# flavor's index), ship the digits example at
# /opt/ddpbus/examples (the chart's default spec), run as the non-root user 10001 and
# start `ddpbus`.
ARG FLAVOR=cpu

# the sources, gathered once
FROM scratch AS src
COPY pyproject.toml README.md /src/
COPY requirements/constraints.txt /src/requirements/
COPY codecs/ /src/codecs/
COPY orchestrator/ /src/orchestrator/
COPY worker_agent/ /src/worker_agent/
COPY examples/ /src/examples/

# slim Python; the CPU build of the pinned torch (the default index would pull CUDA's)
FROM python:3.11.11-slim-bookworm AS base-cpu
ENV PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu

# the CUDA runtime (cuDNN for the user's models); Python in a venv
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 AS base-gpu
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

FROM base-${FLAVOR} AS image
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=src /src /src
WORKDIR /src
RUN pip install -c requirements/constraints.txt ".[train,report,server,examples]" \
    && useradd --uid 10001 --create-home --shell /usr/sbin/nologin ddpbus
COPY --from=src /src/examples/ /opt/ddpbus/examples/
USER 10001:10001
WORKDIR /home/ddpbus
ENTRYPOINT ["ddpbus"]
CMD ["--help"]

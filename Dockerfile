# TensorCast: one image for `tensorcast gs` (the global store), `tensorcast worker` and `tensorcast router`.
#
#   docker build -t tensorcast:0.1.0 .
#   docker build -t tensorcast:0.1.0-torch --build-arg WITH_TORCH=1 .   # adds the CPU wheel of torch
#
# The final stage mounts the builder's wheels (RUN --mount): build with BuildKit, the default builder of
# Docker 23 and later. Deployment: docs/deployment-kubernetes.md.

# 1: also install torch, its CPU build (no CUDA libraries), for callers that hand torch tensors over.
ARG WITH_TORCH=0
ARG TORCH_VERSION=2.13.0
# The project's optional extras to install: etcd for the global store on etcd (overlays/with-etcd), router for
# `tensorcast router` (deploy/kubernetes/router); add tracing for OpenTelemetry spans, or otlp to send them over
# OTLP (--build-arg EXTRAS=etcd,router,otlp); s3 for checkpoints in object storage.
ARG EXTRAS=etcd,router

FROM python:3.11-slim-trixie AS builder

ARG WITH_TORCH
ARG TORCH_VERSION
ARG EXTRAS

WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src

# The project's wheel and a wheel of every dependency (its extras' and torch's too), so that the final stage
# installs from /wheels alone; /wheels/requirements.txt names what it installs, resolved there in one pass.
RUN pip wheel --no-cache-dir --disable-pip-version-check --wheel-dir /wheels ".[${EXTRAS}]" \
 && echo "tensorcast[${EXTRAS}]" > /wheels/requirements.txt \
 && if [ "$WITH_TORCH" = "1" ]; then \
        pip wheel --no-cache-dir --disable-pip-version-check --wheel-dir /wheels \
            --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}" \
     && echo "torch==${TORCH_VERSION}" >> /wheels/requirements.txt; \
    fi


FROM python:3.11-slim-trixie

LABEL org.opencontainers.image.title="tensorcast" \
      org.opencontainers.image.description="TensorCast tensor pool: global store and worker" \
      org.opencontainers.image.licenses="Apache-2.0"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

# The wheels are mounted, not copied, so that no layer keeps them; nothing is downloaded here. --find-links
# lets pip pick one version of a dependency that both the project and torch need.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links=/wheels --requirement /wheels/requirements.txt \
 && groupadd --system --gid 10001 tensorcast \
 && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/tensorcast --no-create-home \
        --shell /usr/sbin/nologin tensorcast \
 && install -d -o 10001 -g 10001 -m 0750 /var/lib/tensorcast

# Numeric, so that Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
WORKDIR /var/lib/tensorcast

# 7070: global store RPC; 7071: worker RPC; 9400: /metrics (and the global store's dashboard). A worker's
# data-plane port is chosen by the system at start (see docs/deployment-kubernetes.md).
EXPOSE 7070 7071 9400

ENTRYPOINT ["tensorcast"]
CMD ["--help"]

# syntax=docker/dockerfile:1
# The resilienced daemon (deploy/kubernetes runs it).  docker build -t resilienced:0.1.0 .
#
# Multi-stage: the builder makes a virtual environment from pinned wheels
# (deploy/images/daemon-requirements.txt) plus this project's own wheel; the final stage is the
# same slim Python with that environment copied in: no compiler, no pip, numeric non-root user,
# nothing written outside /tmp (run it with a read-only root filesystem and /tmp an emptyDir).
# The daemon does not need torch (no "train" extra); Ray is a dependency (it speaks the GCS
# drain protocol) and is ~240 MB of the ~390 MB environment.
#
# Base (both stages, the same): python 3.11.14, Debian bookworm, slim; tag and multi-arch index
# digest (tests/deploy checks the two FROM lines agree).
FROM python:3.11.14-slim-bookworm@sha256:65a93d69fa75478d554f4ad27c85c1e69fa184956261b4301ebaf6dbb0a3543d AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
RUN python -m venv /opt/resilienced
COPY deploy/images/daemon-requirements.txt /src/requirements.txt
RUN /opt/resilienced/bin/pip install --no-cache-dir --only-binary=:all: -r /src/requirements.txt
COPY pyproject.toml README.md /src/
COPY resilienced /src/resilienced
COPY handlers /src/handlers
COPY trainer /src/trainer
# Build this project's wheel (isolated build: setuptools, wheel), install it without resolving
# anything else, compile the byte code now (the root filesystem is read-only at run time), and
# drop the installers from the environment.
RUN /opt/resilienced/bin/pip wheel --no-cache-dir --no-deps --wheel-dir /wheels /src \
 && /opt/resilienced/bin/pip install --no-cache-dir --no-deps /wheels/resilienced-*.whl \
 && /opt/resilienced/bin/python -m compileall -q /opt/resilienced/lib \
 && /opt/resilienced/bin/pip uninstall --yes pip setuptools

FROM python:3.11.14-slim-bookworm@sha256:65a93d69fa75478d554f4ad27c85c1e69fa184956261b4301ebaf6dbb0a3543d
LABEL org.opencontainers.image.title="resilienced" \
      org.opencontainers.image.description="Turns an EC2 interruption notice into a durable checkpoint and a requeued gang" \
      org.opencontainers.image.licenses="Apache-2.0"
# No installer in the final image: the base image's pip/setuptools go too.
RUN python -m pip uninstall --yes pip setuptools wheel
COPY --from=builder /opt/resilienced /opt/resilienced
ENV PATH=/opt/resilienced/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    TMPDIR=/tmp
USER 10001:10001
EXPOSE 8080
HEALTHCHECK --interval=30s --timeout=3s --start-period=20s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2)"]
ENTRYPOINT ["resilienced"]
CMD ["run"]

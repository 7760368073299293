# Image for the outbox publisher sidecar (`outbox-publisher`, the default
# command) and the operator CLIs (`outbox migrate`, `outbox status`,
# `outbox-publisher reconcile`): the pg-kafka-outbox wheel with its publisher,
# confluent and sqlalchemy extras.
#
#   docker build -t outbox:local .
#   docker run --rm -e OUTBOX_DATABASE_URL=postgresql://... -e OUTBOX_KAFKA_BOOTSTRAP=... \
#       -p 127.0.0.1:9187:9187 outbox:local
#   docker run --rm outbox:local outbox-publisher --help
#   docker run --rm -e OUTBOX_DATABASE_URL=postgresql://... outbox:local outbox migrate
#   docker run --rm -e OUTBOX_DATABASE_URL=postgresql://... -e OUTBOX_KAFKA_BOOTSTRAP=... \
#       outbox:local outbox-publisher reconcile
#
# Settings come from the environment (OUTBOX_DATABASE_URL, OUTBOX_KAFKA_BOOTSTRAP
# and OUTBOX_<NAME> for every other setting `outbox-publisher --help` lists) or
# from flags after the command. The publisher serves /metrics, /healthz and
# /readyz on port 9187 (OUTBOX_HTTP_PORT); compose.yaml probes /readyz. On
# SIGTERM it finishes the batch in hand (up to delivery + request timeout, 40 s
# by default) and exits 0, so give it a stop timeout of a minute (`docker stop
# -t 60`, compose `stop_grace_period`).
#
# Two stages: `build` resolves the dependencies and installs the project's
# wheel with its extras into a venv; `runtime` is a fresh slim Python with only
# that venv (no compiler, no source tree, no wheel cache), run as an
# unprivileged user.
# Needs BuildKit (the default builder since Docker 23) for the pip cache mounts.

ARG PYTHON_IMAGE=python:3.11-slim

# --- build: resolve the dependencies into a venv and add the project's wheel ---
FROM ${PYTHON_IMAGE} AS build

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONDONTWRITEBYTECODE=1

# A venv without pip of its own: the base image's pip installs into it.
RUN python -m venv --without-pip /opt/venv

WORKDIR /src

# The extras the image installs: the publisher with both producers, and
# SQLAlchemy for the demo service (examples/demo_service.py) that compose runs.
ARG EXTRAS=publisher,confluent,sqlalchemy

# Dependencies first, from pyproject.toml alone, so that a change to the code
# does not reinstall them: the library's and those of EXTRAS. An extra that
# names the project itself (confluent names publisher) adds nothing here.
COPY pyproject.toml ./
RUN --mount=type=cache,target=/root/.cache/pip \
    python -c "import sys, tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; reqs = p['dependencies'] + [r for e in sys.argv[1].split(',') for r in p['optional-dependencies'][e]]; print('\n'.join(r for r in reqs if not r.startswith(p['name'])))" "$EXTRAS" \
        > /tmp/requirements.txt \
 && pip --python /opt/venv/bin/python install -r /tmp/requirements.txt

# The wheel (pg-kafka-outbox) with EXTRAS, whose requirements are already in
# place: hatchling needs the README (package metadata) and schema/, which the
# wheel force-includes as outbox/schema (the migrations). The check runs
# isolated (-I) so that it sees the installed package, not ./outbox: the
# migrations are there and both producers import.
COPY README.md ./
COPY schema/ schema/
COPY outbox/ outbox/
COPY publisher/ publisher/
RUN --mount=type=cache,target=/root/.cache/pip \
    pip wheel --no-deps --wheel-dir /dist . \
 && wheel="$(echo /dist/pg_kafka_outbox-*.whl)" \
 && pip --python /opt/venv/bin/python install "${wheel}[${EXTRAS}]" \
 && /opt/venv/bin/python -I -c "import importlib.resources as r; assert r.files('outbox').joinpath('schema').is_dir(), 'schema/ missing from the wheel'" \
 && /opt/venv/bin/python -I -c "import publisher.cli, publisher.confluent_sink, sqlalchemy"

# --- runtime: the venv and the examples, no build tools, not root ---
FROM ${PYTHON_IMAGE} AS runtime

LABEL org.opencontainers.image.title="outbox-publisher" \
      org.opencontainers.image.description="Transactional outbox for PostgreSQL and a publisher sidecar that delivers to Apache Kafka" \
      org.opencontainers.image.licenses="Apache-2.0"

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

RUN groupadd --system --gid 10001 outbox \
 && useradd --system --uid 10001 --gid outbox --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin outbox

COPY --from=build /opt/venv /opt/venv
# The demo service (examples/demo_service.py), run by compose.yaml's `demo`.
COPY examples/ /app/examples/

WORKDIR /app
# Numeric, so that runAsNonRoot-style checks can verify it.
USER 10001:10001

# /metrics, /healthz and /readyz of outbox-publisher (OUTBOX_HTTP_PORT).
EXPOSE 9187

# Not an ENTRYPOINT: the same image runs `outbox migrate`, `outbox status` and
# the demo by naming the command.
CMD ["outbox-publisher"]

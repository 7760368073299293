# Everyday commands. `make test` is what CI runs (through .ci/run).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Each recipe line that talks to the services first loads where they are.
WITH_SERVICES := . ./.services.env &&

.PHONY: help venv services services-down lint typecheck imports unit test demo bench soak-freeze soak clean

help:
	@echo "make venv           create .venv with the project and its dev tools"
	@echo "make services       start (or reuse) local PostgreSQL and Kafka; writes .services.env"
	@echo "                    (KAFKA_BROKERS=3: a three-broker Kafka cluster instead of one broker)"
	@echo "make services-down  stop them (either Kafka shape)"
	@echo "make test           ruff, mypy, the import contracts and every test against the real services"
	@echo "make imports        the import contracts (import-linter; see [tool.importlinter] in pyproject.toml)"
	@echo "make unit           only the tests that need no services"
	@echo "make demo           an example service writes orders; a publisher delivers them"
	@echo "make bench          benchmarks: throughput, latency, enqueue cost, growth, publishers, sinks, status at scale, claims at scale, writer scaling"
	@echo "make soak-freeze    publishers frozen and woken at random points: nothing lost or doubled, keys in order (SOAK_ARGS=...)"
	@echo "make soak           30 minutes at 2,000 msg/s on three brokers with publisher, broker and PostgreSQL faults; restarts THIS checkout's services (SOAK_ARGS=...)"

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

venv: $(BIN)/.installed

# KAFKA_BROKERS=3 runs Kafka as a three-broker cluster (OUTBOX_KAFKA_BROKERS;
# see services/README.md). Without it, services/up decides (one broker).
services:
	$(if $(KAFKA_BROKERS),OUTBOX_KAFKA_BROKERS=$(KAFKA_BROKERS) )services/up

services-down:
	services/down

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: venv
	$(BIN)/mypy

# The architecture rules: the library stands alone, nothing imports a command,
# classification and partitioning do no I/O.
imports: venv
	$(BIN)/lint-imports

unit: venv
	$(BIN)/pytest tests/unit

test: lint typecheck imports services
	$(WITH_SERVICES) $(BIN)/pytest

demo: venv services
	$(WITH_SERVICES) $(BIN)/outbox migrate
	$(WITH_SERVICES) $(BIN)/python examples/demo_service.py
	$(WITH_SERVICES) $(BIN)/outbox-publisher --exit-when-idle
	$(WITH_SERVICES) $(BIN)/outbox status; test $$? -le 1
	$(WITH_SERVICES) $(BIN)/python examples/demo_service.py --read

bench: venv services
	$(WITH_SERVICES) $(BIN)/python benchmarks/throughput.py
	$(WITH_SERVICES) $(BIN)/python benchmarks/latency.py
	$(WITH_SERVICES) $(BIN)/python benchmarks/enqueue_cost.py
	$(WITH_SERVICES) $(BIN)/python benchmarks/growth.py
	$(WITH_SERVICES) $(BIN)/python benchmarks/publishers.py
	$(WITH_SERVICES) $(BIN)/python benchmarks/sinks.py --record
	$(WITH_SERVICES) PYTHONPATH=$(CURDIR) $(BIN)/python benchmarks/status_scale.py
	$(WITH_SERVICES) $(BIN)/python benchmarks/claim_scale.py
	$(WITH_SERVICES) $(BIN)/python benchmarks/writer_scaling.py

# Not a test: five to ten minutes per delivery mode. It imports test helpers
# (tests/support.py), and its publishers must run this checkout's code, hence PYTHONPATH.
soak-freeze: venv services
	$(WITH_SERVICES) PYTHONPATH=$(CURDIR) $(BIN)/python benchmarks/freeze_soak.py $(SOAK_ARGS)

# Not a test: half an hour (--minutes), and it kills and restarts the services
# this checkout's services/up started, three brokers unless KAFKA_BROKERS says
# otherwise: run it on an instance of its own (docs/development.md, "Soak").
soak: venv
	OUTBOX_KAFKA_BROKERS=$(or $(KAFKA_BROKERS),3) services/up
	$(WITH_SERVICES) PYTHONPATH=$(CURDIR) $(BIN)/python benchmarks/soak.py $(SOAK_ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .import_linter_cache

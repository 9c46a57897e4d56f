# The two commands a newcomer needs: `make demo` and `make test`.
# Both create (or reuse) .venv and install ddpbus with constraints.txt (torch 2.13.0 CPU).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.ddpbus-deps
EDITABLE := --no-deps --no-build-isolation -e . --config-settings editable_mode=strict

.PHONY: install test test-all lint typecheck pytest pytest-slow flake-hunt chaos-full demo codegen bench \
	fuzz clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --disable-pip-version-check -c constraints.txt setuptools build
	$(PIP) install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev]' \
		--config-settings editable_mode=strict
	touch $(STAMP)

# strict editable installs need a refresh when modules are added
install: $(STAMP)
	$(PIP) install --quiet --disable-pip-version-check $(EDITABLE)

lint: install
	$(VENV)/bin/ruff check .

# mypy from tests/: at the repo root the stdlib `codecs` and ours collide (STYLE.md)
typecheck: install
	cd tests && ../$(VENV)/bin/mypy -p ddpbus.codecs -p ddpbus.orchestrator -p ddpbus.worker_agent

# `make test`: the newcomer suite (unit, contract, fuzz smoke, integration, a chaos smoke per
# failure kind: worker, coordinator, broker), no root needed, ~10 min on 2 cores from a clean
# clone. `make test-all` adds what is marked slow: every other chaos scenario, the soak, the
# rest of the training matrix and the training benchmarks' smoke (`make chaos-full` adds the
# random-moment loops and the broker backend, as the flake hunt does).
# The report test renders the page in Debian's Chromium where it is installed (skipped,
# naming the package, where not); .ci/run installs it and makes its absence a failure.
PYTEST_ARGS ?=
# two pytest-xdist workers: the suite waits on processes and servers about half the time
PYTEST_WORKERS ?= 2
pytest: install
	$(PY) -m pytest -m "not slow" -n $(PYTEST_WORKERS) --durations=15 $(PYTEST_ARGS)

pytest-slow: install
	$(PY) -m pytest -m slow --durations=15 $(PYTEST_ARGS)

# every chaos loop (10 random worker kills, 5 coordinator kills, 5 broker restarts) and the
# broker backend too: what the flake hunt runs each round
chaos-full: install
	DDPTEST_CHAOS_FULL=1 $(PY) -m pytest tests/chaos --durations=15 $(PYTEST_ARGS)

test: lint typecheck pytest

test-all: test pytest-slow

# the flake hunt (issue 33): the integration and chaos tests ROUNDS times in a row with
# one core taken by a busy loop and fresh chaos seeds each round; a table of every test that
# failed in any round lands in bench/results/flake-hunt-*.json
ROUNDS ?= 5
flake-hunt: install
	$(PY) tests/flake_hunt.py --rounds $(ROUNDS) -- -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

# trains examples/digits.py on 2 CPU workers over the embedded broker and prints the result
demo: install
	$(VENV)/bin/ddpbus run examples/digits.py:spec --workers 2

codegen: install
	$(PY) codecs/_codegen.py

bench: install
	$(PY) bench/codec.py
	$(PY) bench/overhead.py
	$(PY) bench/hetero.py
	$(PY) bench/control_latency.py
	$(PY) bench/recovery.py
	$(PY) bench/averaging.py
	$(PY) bench/scale.py

# the fuzz campaign (issue 8): FUZZ_EXAMPLES mutated payloads per message family and kind
# through the hypothesis tests, then ATHERIS_RUNS libFuzzer inputs per atheris target; one
# JSON report (crash inputs, if any, land beside it). `make pytest` runs a small CI share.
FUZZ_EXAMPLES ?= 100000
ATHERIS_RUNS ?= 100000
FUZZ_REPORT ?= build/fuzz/report.json
ATHERIS_TARGETS := ControlMsg TimingMsg MetricsMsg JoinMsg AdmitMsg TensorFrame TensorBlob \
	Snapshot BundleManifest Lease

fuzz: install
	mkdir -p $(dir $(FUZZ_REPORT))
	rm -f $(FUZZ_REPORT)
	DDPTEST_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) DDPTEST_FUZZ_REPORT=$(FUZZ_REPORT) \
		$(PY) -m pytest tests/fuzz --timeout=3600 --ignore=tests/fuzz/test_atheris.py
	for target in $(ATHERIS_TARGETS); do \
		$(PY) tests/fuzz/atheris_decoders.py -atheris_runs=$(ATHERIS_RUNS) -target=$$target \
			-report=$(FUZZ_REPORT) -artifact_prefix=$(dir $(FUZZ_REPORT)) || exit 1; \
	done

clean:
	rm -rf $(VENV) build dist *.egg-info .mypy_cache .ruff_cache .pytest_cache .hypothesis

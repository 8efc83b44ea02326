# hybridkv: `make demo` runs the demo, `make test` runs the whole test suite.
# Both prepare the machine first (scripts/setup.sh); a ready machine is not touched again.

VENV ?= .venv
PY := $(VENV)/bin/python
READY := $(VENV)/.hybridkv-ready
PYTEST_ARGS ?=

.PHONY: demo test test-fast fuzz-long setup clean

$(READY): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $@

setup: $(READY)

demo: $(READY)
	$(VENV)/bin/hybridkv demo

# The suite runs in a private network namespace with only loopback up (see scripts/netns-run).
test: $(READY)
	scripts/netns-run $(PY) -m pytest $(PYTEST_ARGS)

# Everything but the slow end-to-end tests.
test-fast: $(READY)
	scripts/netns-run $(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# The stateful fuzzers with the deep profile.
fuzz-long: $(READY)
	scripts/netns-run $(PY) -m pytest tests -k "fuzz or stateful" --hypothesis-profile=long $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis

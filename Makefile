# hybridkv: `make demo` runs the demo, `make test` runs the whole test suite.
# Both prepare the machine first (scripts/setup.sh); a ready machine is not touched again.
# `make test` also runs the vLLM-facing tests against vLLM 0.33 and 0.34 (`make test-vllm033`, `make test-vllm034`).

VENV ?= .venv
PY := $(VENV)/bin/python
READY := $(VENV)/.hybridkv-ready
PYTEST_ARGS ?=
# `make test` runs the suite on this many pytest-xdist workers (0: one process). A file's tests stay together
# on one worker, in order (`--dist loadfile`): module fixtures start once, and a file's engines never race
# each other. Most engine tests leave a core idle (process starts, server warm-ups, fault waits), so two
# workers on a 2-core host take about half the serial time.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile
# vLLM 0.33 and 0.34 (CUDA builds only) layered over $(VENV): see scripts/setup-vllm03x.sh.
VENV033 ?= .venv-vllm033
READY033 := $(VENV033)/.hybridkv-ready
VENV034 ?= .venv-vllm034
READY034 := $(VENV034)/.hybridkv-ready
# The tests that drive vLLM's Python side (scheduler, KV-cache manager, configs, connector base classes,
# metrics, CLI parser) without kernels or an engine; engine tests are marked `slow` and live elsewhere.
VLLM_LANE_TESTS := tests/connector tests/lifecycle tests/serve/test_metrics_unit.py tests/docs/test_metrics_page.py \
	tests/docs/test_examples.py tests/bench/test_bench_scheduler_inflight.py -m "vllm and not slow"

.PHONY: demo test test-vllm033 test-vllm034 test-fast fuzz-long test-races typecheck setup clean

$(READY): pyproject.toml dev/pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $@

$(READY033): $(READY) scripts/setup-vllm033.sh scripts/setup-vllm03x.sh
	VENV=$(VENV) VENV033=$(VENV033) bash scripts/setup-vllm033.sh
	touch $@

$(READY034): $(READY) scripts/setup-vllm034.sh scripts/setup-vllm03x.sh
	VENV=$(VENV) VENV034=$(VENV034) bash scripts/setup-vllm034.sh
	touch $@

setup: $(READY)

demo: $(READY)
	$(VENV)/bin/hybridkv demo

# The suite runs in a private network namespace with only loopback up (see scripts/netns-run). The
# `registry` tests (pip resolving the `vllm` extra against the package index) start no server and need the
# index, so they run outside it.
test: $(READY) $(READY033) $(READY034)
	scripts/netns-run $(PY) -m pytest -m "not registry" $(XDIST) $(PYTEST_ARGS)
	scripts/netns-run $(VENV033)/bin/python -m pytest $(VLLM_LANE_TESTS) $(XDIST)
	scripts/netns-run $(VENV034)/bin/python -m pytest $(VLLM_LANE_TESTS) $(XDIST)
	$(PY) -m pytest -m registry $(PYTEST_ARGS)

# The scheduler-level tests against vLLM 0.33's and 0.34's Python code over the CPU torch. Both lanes stay in
# `make test` (two workers on an idle 2-core host: 0.33 in 89 s, 0.34 in 79 s; the main suite 17.7 min, the
# registry tests 1.8 min), and 0.33 is still in the supported range with its own differences
# (ModelRunnerOutput.req_id_to_index).
test-vllm033: $(READY033)
	scripts/netns-run $(VENV033)/bin/python -m pytest $(VLLM_LANE_TESTS) $(XDIST) $(PYTEST_ARGS)

test-vllm034: $(READY034)
	scripts/netns-run $(VENV034)/bin/python -m pytest $(VLLM_LANE_TESTS) $(XDIST) $(PYTEST_ARGS)

# Everything but the slow end-to-end tests.
test-fast: $(READY)
	scripts/netns-run $(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# The stateful fuzzers with the deep profile.
fuzz-long: $(READY)
	scripts/netns-run $(PY) -m pytest tests -k "fuzz or stateful" --hypothesis-profile=long $(PYTEST_ARGS)

# The threaded tests (lookups off the scheduler thread, load/save pipelines, late store calls, ownership of
# buffers, concurrent stores) under the interpreter's development checks, switching threads every microsecond
# so that rare interleavings happen all the time, a traceback dump of every thread if one hangs.
RACE_TESTS = tests/connector/test_async_lookup.py tests/connector/test_transfer_ownership.py \
	tests/connector/test_lookup_service.py tests/connector/test_staging_host_buffers.py \
	tests/connector/test_worker.py tests/connector/test_preemption.py tests/connector/test_lifecycle_gates.py \
	tests/connector/test_datapath.py tests/store/test_fuzz.py tests/store/test_file_recycling.py \
	tests/store/test_file_deadline.py
test-races: $(READY)
	PYTHONDEVMODE=1 HYBRIDKV_SWITCH_INTERVAL=1e-6 scripts/netns-run $(PY) -m pytest $(RACE_TESTS) \
		-o faulthandler_timeout=300 $(PYTEST_ARGS)

# mypy --strict over the package under its import name (`hybridkv` is src/). mypy cannot see through the
# editable install's import hook (`mypy src` would read every `hybridkv.*` import as Any), so a link under
# build/ gives it the name.
typecheck: $(READY)
	mkdir -p build/typecheck && ln -sfn ../../src build/typecheck/hybridkv
	MYPYPATH=build/typecheck:dev $(VENV)/bin/mypy --strict -p hybridkv -p hybridkv_dev

clean:
	rm -rf $(VENV) $(VENV033) $(VENV034) build *.egg-info .pytest_cache .hypothesis

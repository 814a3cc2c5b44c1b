# taskgate — every target creates the virtual environment it needs.
VENV   ?= .venv
PY     := $(VENV)/bin/python
# the three distributions' metadata and the exact pins: a change to any of them reinstalls
DISTS  := pyproject.toml clients/python/pyproject.toml clients/api/pyproject.toml
PINS   := $(shell cat $(DISTS) constraints.txt | cksum | cut -d' ' -f1)
STAMP  := $(VENV)/.installed-$(PINS)
# the wheels the packaging tests install, so that `make test` needs no package index once `make venv` has run
WHEELHOUSE := $(VENV)/.wheelhouse-$(PINS)
PYTEST := $(PY) -m pytest
# llama-cpp-python (the upstream-server extra: the upstream backend's real test server) compiles llama.cpp from source:
# portable CPU code, two jobs at a time. It takes 30-75 minutes on two cores, so it is its own target (`make upstream-server`),
# not part of `make venv`: without it the upstream backend's tests skip and say so
LLAMA_BUILD := CMAKE_ARGS="$${CMAKE_ARGS:--DGGML_NATIVE=OFF}" CMAKE_BUILD_PARALLEL_LEVEL="$${CMAKE_BUILD_PARALLEL_LEVEL:-2}"

.PHONY: venv upstream-server buf run test test-unit test-faults test-cluster images test-images lint proto schema tiny-model gpu-check bench constraints lock pin-digests clean

$(STAMP): $(DISTS) constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ./clients/api -e ./clients/python -e '.[worker,local,dev]'
	rm -f $(VENV)/.installed-* && touch $(STAMP)

## llama.cpp's OpenAI-compatible server (llama-cpp-python[server]) for the upstream backend's tests: compiled from source.
upstream-server: $(STAMP)
	$(LLAMA_BUILD) $(PY) -m pip install -q -c constraints.txt -e '.[upstream-server]' \
		|| echo "llama-cpp-python could not be built (it needs cmake and a C++ compiler): the upstream backend's tests skip"

$(WHEELHOUSE): $(STAMP) taskgate_local/wheelhouse.py
	$(PY) -m taskgate_local.wheelhouse
	rm -f $(VENV)/.wheelhouse-* && touch $(WHEELHOUSE)

# buf (lint and breaking checks of protos/) from npm's @bufbuild/buf into $(VENV)/buf; without npm its checks skip
BUF_VERSION := 1.75.0
BUF := $(VENV)/buf/.installed-$(BUF_VERSION)

$(BUF): $(STAMP)
	if command -v npm >/dev/null; then \
		npm install -s --prefix $(VENV)/buf --no-save --no-audit --no-fund @bufbuild/buf@$(BUF_VERSION) \
		&& rm -f $(VENV)/buf/.installed-* && touch $(BUF); \
	else echo "npm not found: buf is not installed, its checks skip (make buf needs it)"; fi

venv: $(STAMP) $(WHEELHOUSE) $(BUF)

## The first command: embedded PostgreSQL + NATS, the four services, and a real demo job.
run: $(STAMP)
	$(PY) -m taskgate_local.dev

## The whole suite against real PostgreSQL, NATS and gRPC (embedded servers, started per session): tests/unit,
## tests/integration/<service> and the quick part of tests/system.
test: venv
	$(PYTEST) -q

## tests/unit alone: no PostgreSQL, NATS or service started (its conftest refuses them), seconds.
test-unit: $(STAMP)
	$(PYTEST) -q tests/unit

## The fault-injection suite: kills every process while tasks run.
test-faults: $(STAMP)
	$(PYTEST) -q -m faults -p no:randomly tests/system/test_faults.py

## One machine as a cluster: three NATS nodes (streams at three replicas), every service replicated, rolled and killed.
test-cluster: $(STAMP)
	$(PYTEST) -q -m cluster -p no:randomly tests/system/test_cluster.py

## The API and CPU-worker images (CUDA=1 adds taskgate-cuda) with podman, buildah or docker; scripts/container_host.sh
## prepares the machine first. Build arguments: PYTHON_IMAGE, TORCH_INDEX_URL, TORCH_CUDA_INDEX_URL, LOCAL_WHEELS, IMAGE_TAG.
images: $(STAMP)
	$(PY) -m taskgate_local.images

## The images end to end as compose.yaml runs them: PostgreSQL, NATS, migrate, the services, a task, SIGTERM (tests/system/test_images.py).
test-images: images
	$(PYTEST) -q -m images -p no:randomly tests/system/test_images.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy taskgate taskgate_api taskgate_client taskgate_local services tests bench

## buf lint of protos/ and buf breaking against the previous release (the compatibility promise of taskgate.v1).
buf: venv
	$(PY) -m taskgate_local.buf

## Regenerates the gRPC code and its typed stubs from protos/ into taskgate_api/v1 (the taskgate-api distribution).
proto: $(STAMP)
	$(PY) -m taskgate_local.protogen

## Builds the tiny random-weight text-to-video pipeline used by tests and the demo.
## taskgate/sql/schema.sql, the whole current schema for readers: a dump of a freshly migrated database.
schema: $(STAMP)
	$(PY) -m taskgate_local.schemafile

tiny-model: $(STAMP)
	$(PY) -m taskgate_local.tinymodel
	$(PY) -m taskgate_local.tinymodel --model ltx-i2v-tiny
	$(PY) -m taskgate_local.tinylm

## Runs every family's tiny pipeline on CUDA: seconds per step, peak GPU memory, device-busy fraction (skips without a GPU).
gpu-check: $(STAMP)
	$(PY) scripts/gpu_check.py

## Every family at its published size on CUDA (random weights): s/step, VAE decode, peak memory, torch_compile, an attention
## backend, device-busy at 1.0/1.5 slots per GPU; JSON in .taskgate/gpu-proof.json; skips without a GPU. GPU_PROOF_ARGS adds options.
.PHONY: gpu-proof
gpu-proof: $(STAMP)
	$(PY) scripts/gpu_proof.py $(GPU_PROOF_ARGS)

## taskgate beside Celery + Redis, procrastinate and PgQueuer, all installed here (bench/requirements.txt); PROFILE=1 adds py-spy profiles.
BENCH_STAMP := $(VENV)/.bench-$(shell cat bench/requirements.txt bench/requirements-nodeps.txt constraints.txt | cksum | cut -d' ' -f1)

$(BENCH_STAMP): $(STAMP) bench/requirements.txt bench/requirements-nodeps.txt constraints.txt
	$(PY) -m pip install -q -c constraints.txt -r bench/requirements.txt
	$(PY) -m pip install -q --no-deps -r bench/requirements-nodeps.txt
	rm -f $(VENV)/.bench-* && touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) -m bench $(if $(PROFILE),--profile)

## Re-pins constraints.txt to what the virtual environment holds (after changing a range in a pyproject.toml); setuptools
## too (torch needs it at run time), then `make lock` rewrites requirements/ from it.
constraints: $(STAMP)
	{ sed -n '1,2p' constraints.txt; $(PY) -m pip freeze --all --exclude pip --exclude-editable | sed 's/+cpu$$//' | grep -v '^taskgate'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

## The hash-locked requirements the images install (requirements/*.txt) from constraints.txt and the pyprojects, with
## pip-compile from a tool environment of its own ($(LOCK_VENV)), not the runtime's; run it after `make constraints`.
## LOCK_ARGS="--only api.txt worker.txt" rewrites some files alone (torch-cuda.txt hashes every platform's CUDA wheels).
LOCK_VENV := .venv-lock
PIP_TOOLS_VERSION := 7.7.0
LOCK_TOOLS := $(LOCK_VENV)/.installed-pip-tools-$(PIP_TOOLS_VERSION)

$(LOCK_TOOLS):
	test -x $(LOCK_VENV)/bin/python || python3 -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q pip-tools==$(PIP_TOOLS_VERSION)
	rm -f $(LOCK_VENV)/.installed-* && touch $(LOCK_TOOLS)

lock: $(STAMP) $(LOCK_TOOLS)
	$(PY) -m taskgate_local.lock --pip-compile $(LOCK_VENV)/bin/pip-compile $(LOCK_ARGS)

## Pins every third-party image of the Dockerfile, compose.yaml and deploy/ to its tag's current digest (skopeo, crane or
## docker buildx asks the registry); `$(PY) -m taskgate_local.digests --check` lists the unpinned ones offline.
pin-digests: $(STAMP)
	$(PY) -m taskgate_local.digests

clean:
	rm -rf .taskgate build *.egg-info

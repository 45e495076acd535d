# kvstate: the two set-up commands are `make demo` and `make test`.
# Each bootstraps .venv on a fresh machine; nothing else needs to be installed by hand.

PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test spec docs check clean

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

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .hypothesis

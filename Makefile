# Two commands on a fresh machine (see README.md):
#   make example   set up .venv and run the main example (profile -> plan -> train -> tune; CPU, GPU when present)
#   make test      set up .venv and run the test suite (what .ci/run calls)
PY ?= python3
VENV ?= .venv

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

.PHONY: setup example test
setup: $(VENV)/.installed

example: setup
	$(VENV)/bin/python examples/auto_plan_demo.py

test: setup
	bash .ci/install_chromium.sh
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider

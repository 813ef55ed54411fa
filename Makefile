# Two commands on a fresh machine (see README.md):
#   make example   set up .venv and run the main example (profile -> plan -> train -> tune; CPU, GPU when present)
#   make test      set up .venv and run the test suite (what .ci/run calls)
PY ?= python3
VENV ?= .venv

# A new .venv takes ~5.5 GiB (torch 2.14.1 + torchvision 0.29.1 are CUDA builds): say so before pip fails half-way.
NEED_GIB ?= 6.5

$(VENV)/.installed: pyproject.toml
	@test -d $(VENV) || $(PY) -c "import shutil, sys; free = shutil.disk_usage('.').free / 2**30; \
	sys.exit(0 if free >= $(NEED_GIB) else f'Setting up $(VENV) needs about $(NEED_GIB) GiB of free disk here, but only {free:.1f} GiB is free. HINT: free some space (old clones with their own .venv, pip caches) and run make again.')"
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

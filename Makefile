# minirl: `make bench` runs the benchmark job, `make test` runs the tests.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
DATA := data

.PHONY: install install-test bwrap test bench data lint clean

# install: what a training run needs (minirl and its dependencies); install-test adds the test
# extras (dev: pytest, import-linter, matplotlib, ...; ray: its launcher's tests; lora: peft), about 2 GB.
install: $(VENV)/.installed
install-test: $(VENV)/.installed-test bwrap

# Reuse a torch that is already importable (GPU machines); otherwise the CPU build torch==2.13.0.
$(VENV)/.installed: pyproject.toml constraints.txt
	@if python3 -c "import torch" 2>/dev/null; then \
	  echo "minirl: using the torch already installed"; python3 -m venv --system-site-packages $(VENV); \
	else python3 -m venv $(VENV); fi
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints.txt -e .
	@touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -c constraints.txt -e '.[dev,ray,lora]'
	@touch $@

# The python tool runs model-written code in a bubblewrap sandbox (docs/agents.md), and its tests
# run it: install bubblewrap with apt-get where it is missing and we are root, else say what to run.
bwrap:
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	  && DEBIAN_FRONTEND=noninteractive apt-get update -qq \
	  && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends bubblewrap; } \
	  || { echo "minirl: the python tool's sandbox needs bubblewrap: run 'apt-get install bubblewrap' as root (Fedora: dnf install bubblewrap)" >&2; exit 1; }

test: install-test
	bash scripts/run_tests.sh $(PY)

$(DATA)/.done: scripts/make_data.py | install
	$(PY) scripts/make_data.py --out $(DATA) --seed 0
	@touch $@

data: $(DATA)/.done

bench: install data
	$(PY) -m minirl --config bench.toml

lint: install-test
	@$(PY) -m ruff --version >/dev/null 2>&1 || $(PIP) install -q ruff
	$(PY) -m ruff check minirl plugins scripts dev tests
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) $(DATA) runs build *.egg-info

# Two commands for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test venv system-deps bench clean

venv: $(STAMP)

# torch is pinned to the CPU build that lies on disk (torch==2.13.0); an unpinned torch would pull
# a multi-GB CUDA build. Everything else comes from setup.cfg.
$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,megatron,deepspeed]'
	touch $@

demo: venv
	$(VENV)/bin/hpcrl run jobs/tiny_grpo.yaml
	$(VENV)/bin/hpcrl report runs/tiny-grpo

system-deps:
	scripts/install-system-deps

test: venv system-deps
	$(PY) -m pytest -q tests

bench: venv
	$(PY) bench/step_breakdown.py

clean:
	rm -rf $(VENV) runs build *.egg-info

VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test demo bench fuzz clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

test: setup
	$(PY) -m pytest tests

demo: setup
	$(PY) scripts/demo.py

bench: setup
	$(PY) bench/bench.py

clean:
	rm -rf $(VENV) build *.egg-info

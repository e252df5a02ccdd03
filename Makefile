VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test demo bench fuzz clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py ckptconv/_sha256x.c ckptconv/_mapguard.c
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

# Coverage-guided fuzzing of the untrusted-input parsers (not part of `make test`).
FUZZ_SECONDS ?= 300
fuzz: setup
	$(PY) -m pip install --quiet atheris
	mkdir -p fuzz/corpus
	$(PY) -c "import sys; sys.path.insert(0, '.'); from tests.security.test_fuzz import SEEDS; [open(f'fuzz/corpus/seed-{k}', 'wb').write(v) for k, v in SEEDS.items()]"
	$(PY) -m fuzz.fuzz_parsers fuzz/corpus -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=2048 -timeout=10

clean:
	rm -rf $(VENV) build *.egg-info

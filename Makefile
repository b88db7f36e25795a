# Two entry points: `make train` and `make test`. Both create .venv on first use.
#   make train                                   train configs/tiny.yaml (CONFIG=FILE for another)
#   make train ARGS="train.max_steps=200 model.n_layer=2"   ... with config overrides
#   make test ARGS="tests/test_config.py -x"     pytest's arguments
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU build of torch that these machines keep on local disk. On a machine with an NVIDIA driver the
# project's range (torch>=2.13) is left to pip, so a CUDA build the user installed stays.
TORCH_CPU ?= torch==2.13.0
CONFIG ?= configs/tiny.yaml
NPROC  ?= $(shell nproc 2>/dev/null || echo 2)
# errors only: pip's -q still shows setuptools' notes on editable installs
PIP_QUIET ?= -qq

.PHONY: venv test-venv train test clean

# what training needs, and nothing else (the options are extras: pyproject.toml)
$(VENV)/.installed: pyproject.toml
	@echo "setting up $(VENV): torch and what training needs (a few minutes the first time)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_QUIET) --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1 && ! $(PY) -c "import torch" 2>/dev/null; then \
		$(PY) -m pip install $(PIP_QUIET) "$(TORCH_CPU)"; fi
	$(PY) -m pip install $(PIP_QUIET) -e .
	touch $@

# the test runners and every optional package the tests use
$(VENV)/.installed-test: $(VENV)/.installed
	@echo "adding the test runners and the optional packages the tests use to $(VENV)"
	$(PY) -m pip install $(PIP_QUIET) -e ".[test]"
	touch $@

venv: $(VENV)/.installed

test-venv: $(VENV)/.installed-test

train: venv
	$(VENV)/bin/dist-llm train --config $(CONFIG) $(ARGS)

test: test-venv
	$(PY) -m pytest -n $(NPROC) --dist loadgroup -q --durations=25 $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache

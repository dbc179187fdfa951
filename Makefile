# The whole set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.lmfuse-installed

# Without an NVIDIA driver, take the CPU build of torch that lies on these machines' disk
# (a plain `torch` would pull a multi-GB CUDA build); with one, keep torch's default.
TORCH_SPEC := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)

.PHONY: demo test check bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test,plot]"
	touch $@

# Train a tiny GPT with lmfuse and in plain PyTorch, decode over a paged KV cache
# (about 30 s on a 2-core CPU); `make check` runs every op against its reference.
demo: $(STAMP)
	$(BIN)/lmfuse demo
	$(BIN)/lmfuse info

check: $(STAMP)
	$(BIN)/lmfuse check

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 tests

bench: $(STAMP)
	$(BIN)/lmfuse bench softmax

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache

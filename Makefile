# Two commands set everything up:  make demo  (install + run the main job)  and  make test.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tunecast-installed
# A CPU build of torch, installed first when no torch is present: an unpinned torch would pull a
# multi-GB CUDA build. On a GPU machine, install your own torch (>= 2.6) into the venv before this.
TORCH_PIN ?= torch==2.13.0
DEMO_CONFIG ?= examples/llama-3.1-8b-lora.yaml
TRAIN_DEMO ?= examples/tiny-lora.yaml

.PHONY: demo test lint typecheck unit clean screenshots browser .venv-deepspeed

# SkyPilot in an environment of its own: it pins click below 8.2, which huggingface_hub 2 does not accept. The
# exported task is read back by SkyPilot's parser from there (tests/unit/launch/test_launch.py).
SKY_VENV ?= .venv-sky
SKY_STAMP := $(SKY_VENV)/.skypilot-installed

$(SKY_STAMP):
	test -x $(SKY_VENV)/bin/python || $(PYTHON) -m venv $(SKY_VENV)
	$(SKY_VENV)/bin/python -m pip install -q "skypilot>=0.8"
	touch $(SKY_STAMP)

# DeepSpeed in an environment of its own, for benchmarks/deepspeed_rank_memory.py: the same torch as $(VENV) (the
# local CPU wheel pip's find-links serves), the transformers, accelerate and peft of constraints.txt, and DeepSpeed's
# ops left to build on first use (DS_BUILD_OPS=0: it is published as an sdist; its C++ ops JIT-compile with g++ and
# ninja). tunecast itself never imports DeepSpeed.
DS_VENV ?= .venv-deepspeed
DS_STAMP := $(DS_VENV)/.deepspeed-installed

.venv-deepspeed: $(DS_STAMP)

$(DS_STAMP): constraints.txt
	test -x $(DS_VENV)/bin/python || $(PYTHON) -m venv $(DS_VENV)
	$(DS_VENV)/bin/python -c "import torch" 2>/dev/null || $(DS_VENV)/bin/python -m pip install -q "$(TORCH_PIN)"
	DS_BUILD_OPS=0 $(DS_VENV)/bin/python -m pip install -q deepspeed==0.19.8 transformers accelerate peft ninja \
		-c constraints.txt
	touch $(DS_STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e ".[dev,qlora]" -c constraints.txt
	# the bytecode a regular install compiles; an editable one leaves it to the first import, which writes none where
	# PYTHONDONTWRITEBYTECODE is set, so that every command compiled the package again (0.1-0.2 s of a cold estimate)
	$(BIN)/python -m compileall -q src/tunecast >/dev/null
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/tunecast validate $(DEMO_CONFIG)
	$(BIN)/tunecast plan $(DEMO_CONFIG)
	rm -rf runs/tiny-lora
	$(BIN)/tunecast train $(TRAIN_DEMO)

# Chromium for the browser tests and the screenshots: installed from the distribution when missing
browser:
	@scripts/ensure_chromium.sh

# the README's picture of the plan report
screenshots: $(STAMP) browser
	$(BIN)/python scripts/screenshots.py

lint: $(STAMP)
	$(BIN)/ruff check src tests scripts benchmarks
	$(BIN)/mypy

unit: $(STAMP) $(SKY_STAMP) browser
	$(BIN)/pytest -q -n 2 --dist worksteal --durations=25

# The three installs wait mostly on downloads, so they run side by side, the lint as soon as the main one is done;
# then the tests.
test:
	$(MAKE) --no-print-directory -j3 --output-sync=target lint $(SKY_STAMP) browser
	$(MAKE) --no-print-directory unit

clean:
	rm -rf $(VENV) $(SKY_VENV) $(DS_VENV) .pytest_cache .mypy_cache .ruff_cache

# Two commands on a fresh machine:
#   make lab    set up (once), copy any lab you lack into my-labs/ (your work,
#               git-ignored, never overwritten), then open JupyterLab there
#   make test   set up (once), then run every test in one pytest session: unit tests,
#               strict nbval over solutions/, lax nbval over labs/ (course_lib/classroom/notebooks/nbval_plugin.py)
# Set-up is incremental: the venv is created once, torch is installed only when
# missing, and the package is reinstalled only when pyproject.toml changes.
# DeepSpeed installs as pure Python (DS_BUILD_OPS=0); the C++ ops it compiles with g++ on first use
# on CPU (shared-memory comm, pinned memory; async_io for NVMe offload, with libaio-dev) are built
# when a lab or test first imports DeepSpeed, once, under a file lock (course_lib/deepspeed/ops.py),
# so that `make lab` opens JupyterLab without waiting for g++.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# Every command below runs with the venv's bin/ first on the PATH: torch's C++ extension builder
# (DeepSpeed's ops) looks for `ninja` there, and pip puts it in the venv, not in /usr/bin.
export PATH := $(abspath $(BIN)):$(PATH)
STAMP  := $(VENV)/.installed
# Machines without an NVIDIA driver get the tested CPU release (the notebooks' printed numbers
# were produced with it): its CPU build (+cpu) from the configured indexes (a local wheel) or from
# PyTorch's CPU index, so no CUDA wheel is downloaded; only if both fail, PyPI's torch (on Linux a
# CUDA build, ~4 GB), said in a note. macOS: PyPI's wheel is the CPU one. GPU machines get torch >= 2.4.
# The CPU pin is written only here (`make torch` installs it; .ci/run and set-up use that).
TORCH_CPU   ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
HAS_GPU     := $(shell command -v nvidia-smi 2>/dev/null)
JOBS   ?= 2
DURATIONS ?= 20
# The course's plugin: notebooks checked strictly in solutions/ and laxly in labs/, the longest files first, and a
# worker that dies fails its file instead of hanging the session (course_lib/classroom/notebooks/xdist_crash.py).
# Python's bytecode cache stays on whatever the environment says: where PYTHONDONTWRITEBYTECODE=1 (Docker images, CI
# machines), each of the hundreds of Python processes a run starts would compile every module it imports again
# (collecting the tests alone: 11.5 s of CPU per worker instead of 7.3). The caches are git-ignored __pycache__/ folders.
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -n $(JOBS) --dist loadfile --durations=$(DURATIONS) -q -p course_lib.classroom.notebooks.nbval_plugin
NBVAL_OPTS := --nbval-cell-timeout=300 --sanitize-with tests/nbval_sanitize.cfg
# Students work here; labs/ is generated and released (see course_lib/classroom/notebooks/workspace.py).
WORKSPACE ?= my-labs
# The course as a static website (course_lib/classroom/site/).
SITE ?= build/site

.PHONY: lab test test-fast torch setup graphviz browser labs figures solutions benchmarks sweep site gpu-check clean help

help:
	@echo "make lab        set up, copy new labs into $(WORKSPACE)/ (never over your work), open JupyterLab there"
	@echo "make test       set up and run every test (unit + notebooks)"
	@echo "make test-fast  the inner loop (< 1 min): unit tests not marked slow, no notebooks"
	@echo "make labs       regenerate labs/ from solutions/ (never overwrites a hand-edited notebook)"
	@echo "make solutions  re-execute solutions/ in place (refreshes their stored outputs)"
	@echo "make figures    regenerate figures/"
	@echo "make benchmarks print the speed figures"
	@echo "make sweep      run the Day 22 configs A-F, D-distopt, D-zero3 on 8 ranks (~4 min), refresh figures/day22_*"
	@echo "make gpu-check  on a machine with an NVIDIA GPU: the CUDA/NCCL tests and a measured-vs-projected step (course_lib/classroom/gpu_check.py)"
	@echo "make site       build the course as a website in $(SITE)/ (open $(SITE)/index.html; works offline)"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	@$(BIN)/python -c "import torch" 2>/dev/null || $(MAKE) --no-print-directory torch
	DS_BUILD_OPS=0 $(BIN)/python -m pip install -q -e ".[dev,megatron,deepspeed]"
	@touch $@

torch: | $(BIN)/python
ifneq ($(HAS_GPU),)
	$(BIN)/python -m pip install "torch>=2.4"
else ifeq ($(shell uname -s),Darwin)
	$(BIN)/python -m pip install "$(TORCH_CPU)"
else
	@echo '$(BIN)/python -m pip install --retries 0 --timeout 20 --extra-index-url $(TORCH_INDEX) "$(TORCH_CPU)+cpu"'
	@$(BIN)/python -m pip install --retries 0 --timeout 20 --extra-index-url $(TORCH_INDEX) "$(TORCH_CPU)+cpu" || { \
	  echo "note: $(TORCH_CPU)+cpu is neither in your pip indexes nor at $(TORCH_INDEX): installing PyPI's $(TORCH_CPU) (a CUDA build, ~4 GB; it runs on CPU too)"; \
	  $(BIN)/python -m pip install "$(TORCH_CPU)"; }
endif

graphviz:
	@command -v dot >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get install -y -q graphviz >/dev/null || { apt-get update -q && apt-get install -y -q graphviz; }; \
	  else \
	    echo "Graphviz's 'dot' program is missing: run 'sudo apt-get install graphviz' (macOS: 'brew install graphviz'; conda: use environment.yml), then re-run make"; exit 1; \
	  fi; }

setup: $(STAMP) graphviz

# tests/classroom/test_site.py opens the built website in headless Chromium (Debian's chromium) and
# checks that the Chinese terms are drawn with a CJK font; without them that test is skipped
# (no browser) or says what to install (no font).
browser:
	@{ command -v chromium || command -v chromium-browser || command -v google-chrome; } >/dev/null 2>&1 \
	  && { ! command -v fc-list >/dev/null 2>&1 || [ -n "$$(fc-list :lang=zh)" ]; } || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get install -y -q chromium fonts-noto-cjk >/dev/null || { apt-get update -q && apt-get install -y -q chromium fonts-noto-cjk; } \
	      || echo "note: could not install chromium and fonts-noto-cjk; the website's browser test will be skipped"; \
	  else \
	    echo "note: the website's browser test needs Chromium and a CJK font: 'sudo apt-get install chromium fonts-noto-cjk'"; \
	  fi; }

lab: setup
	$(BIN)/python -m course_lib workspace --dir $(WORKSPACE)
	$(BIN)/jupyter lab --ServerApp.root_dir=$(WORKSPACE) $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

# DeepSpeed's ops are built before the notebooks run (their stored outputs lack the build's progress line).
test: setup browser
	$(BIN)/python -m course_lib labs --check
	$(BIN)/python -m course_lib.deepspeed.ops
	$(PYTEST) solutions labs tests --nbval $(NBVAL_OPTS)

# The inner loop while editing course_lib/: unit tests only, without those marked slow (pyproject.toml) and
# the files measured longest (tests/conftest.py).
test-fast: setup
	$(PYTEST) -m "not slow" tests

labs: setup
	$(BIN)/python -m course_lib labs

# One intra-op thread, as under make test (nbval_plugin._one_thread_per_process): the printed numbers do not depend on
# the machine's core count.
solutions: setup
	OMP_NUM_THREADS=1 $(BIN)/jupyter nbconvert --to notebook --execute --inplace solutions/[0-9][0-9]_*.ipynb
	$(BIN)/python -m course_lib labs

figures: setup
	$(BIN)/python -m course_lib figures --out figures

sweep: setup
	$(BIN)/python -m course_lib sweep --configs all,D-distopt,D-zero3 --out logs/day22 --figures figures $(SWEEP_ARGS)

site: setup
	$(BIN)/python -m course_lib site --out $(SITE) $(SITE_ARGS)

gpu-check: setup
	$(BIN)/python -m course_lib.classroom.gpu_check $(GPU_CHECK_ARGS)

benchmarks: setup
	@for b in benchmarks/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info

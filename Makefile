# Two commands on a fresh machine:
#   make lab    set up (once), copy any lab you lack into my-labs/ (your work,
#               git-ignored, never overwritten), then open JupyterLab there
#   make test   set up (once), then run every test in one pytest session: unit tests,
#               strict nbval over solutions/, lax nbval over labs/ (course_lib/classroom/notebooks/nbval_plugin.py)
# Set-up is incremental: the venv is created once, torch is installed only when
# missing, and the package is reinstalled only when pyproject.toml changes.
# DeepSpeed installs as pure Python (DS_BUILD_OPS=0); the two C++ ops it compiles with g++ on
# first use on CPU (shared-memory comm; async_io for NVMe offload, with libaio-dev) are built once here.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Machines without an NVIDIA driver get the tested CPU release (the notebooks'
# printed numbers were produced with it); GPU machines get any torch >= 2.4.
# The CPU pin is written only here (.ci/run reads it: make -s print-torch-cpu).
TORCH_CPU  ?= torch==2.13.0
TORCH_SPEC ?= $(if $(shell command -v nvidia-smi 2>/dev/null),torch>=2.4,$(TORCH_CPU))
JOBS   ?= 2
PYTEST := $(BIN)/python -m pytest -n $(JOBS) --dist loadfile --durations=12 -q
NBVAL_OPTS := --nbval-cell-timeout=300 --sanitize-with tests/nbval_sanitize.cfg
# Students work here; labs/ is generated and released (see course_lib/classroom/notebooks/workspace.py).
WORKSPACE ?= my-labs
# The course as a static website (course_lib/classroom/site/).
SITE ?= build/site

.PHONY: lab test setup graphviz browser labs figures solutions benchmarks sweep site gpu-check clean help print-torch-cpu

help:
	@echo "make lab        set up, copy new labs into $(WORKSPACE)/ (never over your work), open JupyterLab there"
	@echo "make test       set up and run every test (unit + notebooks)"
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
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install "$(TORCH_SPEC)"
	DS_BUILD_OPS=0 $(BIN)/python -m pip install -q -e ".[dev,megatron,deepspeed]"
	$(BIN)/python -m course_lib.deepspeed.engine --build-ops
	@touch $@

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

test: setup browser
	$(BIN)/python -m course_lib labs --check
	$(PYTEST) -p course_lib.classroom.notebooks.nbval_plugin solutions labs tests --nbval $(NBVAL_OPTS)

labs: setup
	$(BIN)/python -m course_lib labs

solutions: setup
	$(BIN)/jupyter nbconvert --to notebook --execute --inplace solutions/[0-9][0-9]_*.ipynb
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

print-torch-cpu:
	@echo '$(TORCH_CPU)'

clean:
	rm -rf $(VENV) build *.egg-info

# paged-kv-course: `make lab` to learn, `make test` to check everything, `make book` to read.
# Each creates .venv and installs what it needs on first use (a learner gets the course's own
# dependencies; tests and the book add their extras); later runs re-install only when
# pyproject.toml changes (the stamp files below).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
LAB_STAMP := $(VENV)/.paged-kv-course-lab
STAMP := $(VENV)/.paged-kv-course-installed
BOOK_STAMP := $(VENV)/.paged-kv-course-book
KERNEL := paged-kv-course
KERNEL_DISPLAY := Python 3 (paged-kv-course)

# Strict nbval: every stored output is compared, after tests/nbval_sanitize.cfg's regexes.
NBVAL := --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg \
	--nbval-cell-timeout 600

# In parallel (pytest-xdist): one worker per CPU (-n auto; 1 on one core), each notebook whole on
# one worker (its cells share one kernel) and so are a module's tests that share a fixture it
# builds once; every other test goes to the next free worker (tests/conftest.py sets the groups).
# XDIST= runs everything in this process, one test after another.
XDIST ?= -n auto --dist loadgroup

# Stored outputs must not depend on the backend: after the run under the automatic backend
# (Triton's interpreter on a CPU, triton-cuda on a GPU) the notebooks run again under each of
# these (COURSE_BACKEND, see README). tests/conftest.py is loaded as a plugin for its chNN marks.
# Nor on the CPU: the second run also forces torch's plain (non-vector) CPU kernels, whose float
# rounding differs from the AVX2 / AVX-512 ones the first run used (ATEN_CPU_CAPABILITY).
ALSO_BACKENDS ?= torch-reference
AGAIN_CPU ?= default
NBVAL_AGAIN = for b in $(ALSO_BACKENDS); do \
	ATEN_CPU_CAPABILITY=$(AGAIN_CPU) COURSE_BACKEND=$$b \
	$(PY) -m pytest -p tests.conftest notebooks $(NBVAL) $(XDIST) $(1) || exit 1; done

# make test-chapter CH=00_setup (or CH=00): the chapter's notebook plus the tests marked chNN.
CH ?=
CH_NUM = $(firstword $(subst _, ,$(CH)))

# jupyter refuses to run as root without this flag (CI and container machines run as root).
LAB_ARGS ?= $(if $(filter 0,$(shell id -u)),--allow-root)

.DEFAULT_GOAL := help
.PHONY: help install lab test test-fast test-chapter test-notebooks test-deep test-browser \
	test-fidelity book lint clean

help:
	@echo "make lab                    start JupyterLab on notebooks/ (installs .venv first if needed)"
	@echo "make test                   unit tests + every notebook with nbval (again under torch-reference)"
	@echo "make test-fast              unit tests only"
	@echo "make test-chapter CH=00_setup   one chapter: its notebook and the tests marked ch00"
	@echo "make test-notebooks CPU=avx2    every notebook with nbval, torch's CPU kernels forced"
	@echo "make test-deep              the property tests alone, with ten times the examples"
	@echo "make test-browser           every chapter in JupyterLab driven by Chromium (needs /usr/bin/chromium)"
	@echo "make test-fidelity          V1's managers, scheduler and CPU tier, the radix cache, beside vLLM 0.33.0's / SGLang 0.5.23's"
	@echo "make book                   the course as a static HTML book in build/book/ (stored outputs)"
	@echo "make lint                   ruff check"
	@echo "make clean                  remove .venv and caches"

$(PY):
	$(PYTHON) -m venv $(VENV)

# what a learner needs: the course and JupyterLab, with the course's kernel registered
$(LAB_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -e .
	$(PY) -m ipykernel install --sys-prefix --name $(KERNEL) --display-name "$(KERNEL_DISPLAY)"
	touch $@

# + the test tools (pytest, nbval, hypothesis, playwright, transformers, ...) and the book's
$(STAMP): pyproject.toml $(LAB_STAMP)
	$(PY) -m pip install -e '.[dev,book]'
	touch $@

# + the book's toolchain only
$(BOOK_STAMP): pyproject.toml $(LAB_STAMP)
	$(PY) -m pip install -e '.[book]'
	touch $@

install: $(STAMP)

lab: $(LAB_STAMP)
	$(BIN)/jupyter lab --notebook-dir=notebooks --ServerApp.ip=127.0.0.1 $(LAB_ARGS)

test: $(STAMP)
	$(BIN)/ruff check course_lib tests bench
	$(PY) -m pytest tests notebooks $(NBVAL) $(XDIST) --durations=25
	$(call NBVAL_AGAIN)

test-fast: $(STAMP)
	$(PY) -m pytest tests $(XDIST)

test-chapter: $(STAMP)
	@test -n "$(CH)" || { echo "usage: make test-chapter CH=00_setup"; exit 2; }
	$(PY) -m pytest tests notebooks $(NBVAL) $(XDIST) -m ch$(CH_NUM)
	$(call NBVAL_AGAIN,-m ch$(CH_NUM))

# Every notebook once more, with torch's CPU kernels forced to CPU (default, avx2, avx512):
# stored outputs must be the same whatever vector unit computed them (.ci/run uses avx2).
CPU ?= default
test-notebooks: $(STAMP)
	ATEN_CPU_CAPABILITY=$(CPU) $(PY) -m pytest -p tests.conftest notebooks $(NBVAL) $(XDIST)

# The property tests alone (-m hypothesis: every @given test and state machine) with ten times
# the examples each draws in `make test` (tests/property_budget.py); .ci/run runs it.
test-deep: $(STAMP)
	HYPOTHESIS_PROFILE=deep $(PY) -m pytest tests -m hypothesis $(XDIST) --durations=10

# A learner's walk in a real browser: JupyterLab on 127.0.0.1 + Playwright driving Debian's chromium.
test-browser: $(STAMP)
	COURSE_BROWSER_TEST=1 $(PY) -m pytest tests/browser -p no:cacheprovider

# The course's V1 managers (one group and hybrid), V1 scheduler with a KV connector, CPU tier and
# radix cache run side by side with vLLM 0.33.0's and SGLang 0.5.23's own code (tests/fidelity/):
# their sources are fetched once into FIDELITY_CACHE (PyPI, sha256 checked), then the harness and
# chapter 03's vLLM file check run on them.
FIDELITY_CACHE ?= .fidelity-cache
test-fidelity: $(STAMP)
	$(PY) tests/fidelity/fetch.py $(FIDELITY_CACHE)
	COURSE_FIDELITY=1 COURSE_FIDELITY_CACHE=$(FIDELITY_CACHE) \
	COURSE_VLLM_SRC=$(FIDELITY_CACHE)/vllm-0.33.0 COURSE_VLLM06_SRC=$(FIDELITY_CACHE)/vllm-0.6.3 \
	COURSE_SGLANG_SRC=$(FIDELITY_CACHE)/sglang-0.5.23 \
	$(PY) -m pytest tests/fidelity \
	tests/test_ch01_03_articles.py::test_component_table_vllm_files_and_classes_exist \
	-p no:cacheprovider
	COURSE_VLLM_SRC=$(FIDELITY_CACHE)/vllm-0.33.0-map \
	COURSE_SGLANG_SRC=$(FIDELITY_CACHE)/sglang-0.5.23-map \
	$(PY) -m pytest tests/test_ch13.py::test_the_map_cites_files_that_exist -p no:cacheprovider

book: $(BOOK_STAMP)
	$(PY) scripts/build_book.py

lint: $(STAMP)
	$(BIN)/ruff check course_lib tests bench

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .ruff_cache build *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

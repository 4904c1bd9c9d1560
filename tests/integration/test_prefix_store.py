"""The paged cache's filed blocks kept across a restart (serving/prefix_store.py): a new engine on the
same file starts from them with the fresh tokens; another file, a damaged file or a smaller cap
restore nothing or less, and never a wrong block."""

import os
import signal
import socket
import subprocess
import sys
import urllib.request

import numpy as np
import openai
import pytest
from support import drain_outputs, wait_until
from support.tiny_models import write_tiny_gguf

from webapp.engine.decoding.sampling_params import SamplingParams
from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread
from webapp.engine.serving.engine import Engine
from webapp.engine.serving.loader import load_gguf_model
from webapp.engine.serving.prefix_store import PrefixStore
from webapp.engine.serving.request import Request

RNG = np.random.default_rng(11)
SYSTEM = [int(t) for t in RNG.integers(2, 4000, 70)]  # four whole blocks of 16, then six positions
QUESTIONS = [[int(t) for t in RNG.integers(2, 4000, 9)] for _ in range(2)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_gguf(str(tmp_path_factory.mktemp("store") / "tiny.gguf"), matrix_type="Q8_0")


def _run(path, store, prompts):
    """Each prompt's greedy tokens and cached tokens, one after another, in a fresh paged engine that
    saves its prefix cache as it stops."""
    use_tinygrad_from_this_thread()  # the last engine's model thread had it
    engine = Engine(lambda: load_gguf_model(path, 2, 256, 16, paging=(2, None)), slots=2, prefill_chunk=16, prefix_store=store)
    engine.start()
    try:
        assert wait_until(lambda: engine.state != "loading", timeout=120) and engine.state == "ok", engine.error
        assert engine.loaded.kv_pool is not None
        answers = []
        for prompt in prompts:
            request = Request(prompt, SamplingParams(max_tokens=6, temperature=0.0))
            engine.submit(request)
            answers.append((drain_outputs(request, timeout=120)[0], request.cached_tokens))
        return answers
    finally:
        engine.stop(30)


def test_a_restarted_engine_starts_from_the_saved_blocks_with_the_fresh_tokens(tiny, tmp_path):
    store = PrefixStore(str(tmp_path / "cache"), 1 << 30, tiny)
    fresh = _run(tiny, None, [SYSTEM + QUESTIONS[1]])
    [(_, cached)] = _run(tiny, store, [SYSTEM + QUESTIONS[0]])
    assert cached == 0 and os.path.exists(store.path)
    [(tokens, cached)] = _run(tiny, PrefixStore(str(tmp_path / "cache"), 1 << 30, tiny), [SYSTEM + QUESTIONS[1]])
    assert cached == 64 and [(tokens, 0)] == fresh  # the system prompt's four whole blocks


def test_another_file_a_damaged_file_and_a_smaller_cap(tiny, tmp_path):
    folder = str(tmp_path / "cache")
    _run(tiny, PrefixStore(folder, 1 << 30, tiny), [SYSTEM + QUESTIONS[0]])
    other = write_tiny_gguf(str(tmp_path / "tiny.gguf"), matrix_type="Q8_0", seed=5)  # the same name, other weights
    assert PrefixStore(folder, 1 << 30, other).path != PrefixStore(folder, 1 << 30, tiny).path
    [(_, cached)] = _run(other, PrefixStore(folder, 1 << 30, other), [SYSTEM + QUESTIONS[1]])
    assert cached == 0
    store = PrefixStore(folder, 1 << 30, tiny)
    with open(store.path, "r+b") as f:  # damaged in the middle
        f.seek(os.path.getsize(store.path) // 2)
        f.write(b"\xff" * 64)
    [(_, cached)] = _run(tiny, store, [SYSTEM + QUESTIONS[1]])
    assert cached == 0  # refused; this run saved a good file again, which the next one restores
    with np.load(store.path) as saved:
        block_bytes = sum(saved[f"layer{i}"][0].nbytes for i in range(int(saved["header"][2])))
    [(_, cached)] = _run(tiny, PrefixStore(folder, 2 * block_bytes + 100, tiny), [SYSTEM + QUESTIONS[0]])
    assert cached == 64
    [(_, cached)] = _run(tiny, store, [SYSTEM + QUESTIONS[1]])
    assert cached == 32  # the capped save kept the system prompt's first two blocks


def _waitress(path, folder, log):
    """The app in a waitress process of its own, as `make serve` runs it, ready; (process, port)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "DEV": "CPU", "LLM_MODEL": path, "LLM_PREFIX_CACHE_DIR": folder, "LLM_MAX_CONTEXT": "512"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    argv = [sys.executable, "-m", "waitress", f"--listen=127.0.0.1:{port}", "wsgi:app"]
    process = subprocess.Popen(argv, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)

    def ready():
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return process.poll() is not None

    assert wait_until(ready, timeout=120) and process.poll() is None, "the server did not start"
    return process, port


def test_a_server_stopped_by_sigterm_and_started_again_answers_from_the_saved_blocks(tiny, tmp_path):
    """The real thing: waitress, the openai client, SIGTERM (drain, then the model thread saves)."""
    folder, system = str(tmp_path / "cache"), {"role": "system", "content": "You are the museum's guide. " * 12}
    with open(tmp_path / "server.log", "wb") as log:
        for round_, question in enumerate(("Where are the fossils?", "And the telescopes?")):
            process, port = _waitress(tiny, folder, log)
            try:
                with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60) as client:
                    messages = [system, {"role": "user", "content": question}]
                    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
                cached = reply.usage.prompt_tokens_details.cached_tokens
                assert cached == 0 if round_ == 0 else cached >= 64, cached  # the system prompt's whole blocks
            finally:
                process.send_signal(signal.SIGTERM)
                assert process.wait(60) == 0
            assert any(name.endswith(".kvcache.npz") for name in os.listdir(folder))


KILLED_MIDWAY = """
import os, signal, sys
import numpy as np
sys.path[:0] = [{tests!r}, {here!r}]
from test_prefix_store import SYSTEM, QUESTIONS, _run
from webapp.engine.serving.prefix_store import PrefixStore

def killed(f, **arrays):  # half a file written, then kill -9: no handler runs, nothing is cleaned up
    f.write(b"PK\\x03\\x04" + bytes(4096))
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)

np.savez = killed
_run({model!r}, PrefixStore({folder!r}, 1 << 30, {model!r}), [SYSTEM + QUESTIONS[1]])
"""


def test_a_save_killed_midway_or_out_of_disk_leaves_the_last_good_file(tiny, tmp_path, monkeypatch, caplog):
    folder = str(tmp_path / "cache")
    store = PrefixStore(folder, 1 << 30, tiny)
    _run(tiny, store, [SYSTEM + QUESTIONS[0]])
    good = open(store.path, "rb").read()
    here = os.path.dirname(os.path.abspath(__file__))
    script = KILLED_MIDWAY.format(tests=os.path.dirname(here), here=here, model=tiny, folder=folder)
    killed = subprocess.run([sys.executable, "-c", script], cwd=os.path.dirname(os.path.dirname(here)), capture_output=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    partials = [name for name in os.listdir(folder) if name.endswith(".partial")]
    assert len(partials) == 1 and open(store.path, "rb").read() == good

    def disk_full(f, **arrays):
        f.write(bytes(1000))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("webapp.engine.serving.prefix_store.np.savez", disk_full)
    with caplog.at_level("INFO"):
        [(_, cached)] = _run(tiny, store, [SYSTEM + QUESTIONS[1]])
    assert cached == 64  # the last good file, restored; the save as this engine stopped found the disk full
    assert "save cut short" in caplog.text and "No space left on device" in caplog.text
    assert open(store.path, "rb").read() == good
    assert [name for name in os.listdir(folder) if name.endswith(".partial")] == partials  # the full disk's bytes removed
    monkeypatch.undo()
    [(_, cached)] = _run(tiny, store, [SYSTEM + QUESTIONS[0]])
    assert cached == 64

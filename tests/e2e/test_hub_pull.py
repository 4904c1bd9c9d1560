"""`LLM_MODEL=hf:org/repo:QUANT` end to end, against a local stand-in for the Hub (`HF_ENDPOINT`,
tests/support/fake_hub.py), never the network: the server, started as `make serve` starts it, says
`loading` while the files come, then serves the named file with its projector to the openai
client (the dashboard saying what is being fetched meanwhile); a second start fetches nothing; a
download broken off resumes from the bytes it has; a split file's parts are joined once; a file
whose bytes do not match the sha256 the Hub lists is deleted and refused; names that cannot be
pulled say why in one line; without the Hub, a former pull is served from the cache."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading

import openai
import pytest
from support import ROOT, get
from support.fake_hub import FakeHub
from support.split_files import write_split
from support.tiny_models import write_tiny_gguf
from support.tiny_projectors import write_tiny_projector

from webapp.engine.model.gguf import read_gguf

sys.path.insert(0, str(ROOT / "bench"))
from servers import free_port, health_status, start_ours  # noqa: E402

REPO = "tiny-org/Tiny-GGUF"
SPLIT_REPO = "tiny-org/Split-GGUF"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hub")
    model = write_tiny_gguf(str(folder / "m.gguf"), "gemma3", matrix_type="Q8_0", context=256)
    # a float32 embedding: over the 10 MiB the library writes at a time, so that a cut-off download has bytes to resume from
    other = write_tiny_gguf(str(folder / "o.gguf"), "llama", matrix_type="Q4_0", context=256, quantize_embedding=False)
    projector = write_tiny_projector(str(folder / "p.gguf"), "gemma3", text_dim=64)
    files = {"README.md": b"# tiny\n", "tiny-Q8_0.gguf": model, "tiny-Q4_0.gguf": other, "mmproj-tiny-f16.gguf": projector}
    parts = write_split(other, str(folder / "tiny-Q4_0"), 3)
    repos = {REPO: {name: value if isinstance(value, bytes) else open(value, "rb").read() for name, value in files.items()}}
    repos[SPLIT_REPO] = {f"Q4_0/{os.path.basename(p)}": open(p, "rb").read() for p in parts}
    with FakeHub(repos) as fake:
        fake.original = other
        yield fake


def test_a_named_model_is_pulled_while_health_says_loading_then_served_then_found_in_the_cache(hub, tmp_path):
    env = {"LLM_MODEL": f"hf:{REPO}:q8_0", "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "LLM_LOG_LEVEL": "info"}
    port, seen, shown, stop = free_port(), set(), set(), threading.Event()
    server = type("S", (), {"host": "127.0.0.1", "port": port})()

    def watch():
        while not stop.wait(0.1):
            seen.add(health_status(port))
            with contextlib.suppress(OSError, ValueError):
                shown.add(get(server, "/admin/stats.json", timeout=2)[2].get("download"))

    hub.delay_s = 3.0  # the download takes a while: /health is asked meanwhile
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with start_ours(port=port, env=env, timeout=120) as ours:
            stop.set()
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{ours.port}/v1", api_key="unused", max_retries=0, timeout=120)
            reply = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0)
            assert reply.usage.completion_tokens > 0 and [m.id for m in client.models.list()] == ["tiny-Q8_0"]
            assert "projector" in ours.log_tail(20000) and "images:" in ours.log_tail(20000)
            assert get(server, "/health")[0] == 200
    finally:
        stop.set()
        hub.delay_s = 0.0
    assert 503 in seen  # loading, while the files came
    size = len(hub.repos[REPO]["tiny-Q8_0.gguf"]) / 2**20
    assert f"downloading hf:{REPO}/tiny-Q8_0.gguf: 0.0 MiB of {size:.1f} MiB" in shown  # the dashboard said so
    assert hub.served == {"tiny-Q8_0.gguf": 1, "mmproj-tiny-f16.gguf": 1}
    with start_ours(env=env, timeout=120):  # the same cache: nothing fetched again
        pass
    assert hub.served == {"tiny-Q8_0.gguf": 1, "mmproj-tiny-f16.gguf": 1}


def pull_error(name: str, env: dict) -> tuple[int, str]:
    """Exit status and last line of a process that pulls `name` (the server's loader does the same)."""
    code = f"from webapp.engine.serving.hub_pull import pull; pull({name!r})"
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, cwd=ROOT, timeout=120)
    return done.returncode, (done.stderr.strip().splitlines() or [""])[-1]


def test_a_download_broken_off_resumes_where_it_stopped(hub, tmp_path):
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf")}
    chunk = 10 * 2**20  # huggingface_hub's DOWNLOAD_CHUNK_SIZE: what it has written when the connection drops
    hub.cut_once["tiny-Q4_0.gguf"], hub.ranges = chunk + 12_345, {}
    status, line = pull_error(f"hf:{REPO}:Q4_0", env)  # the library asks again, from the bytes it has
    assert status == 0, line
    assert hub.ranges["tiny-Q4_0.gguf"] == [0, chunk]


def test_a_file_that_fails_its_checksum_is_deleted_and_refused(hub, tmp_path):
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf")}
    hub.corrupt.add("tiny-Q4_0.gguf")
    try:
        status, line = pull_error(f"hf:{REPO}:Q4_0", env)
    finally:
        hub.corrupt.clear()
    assert status == 1 and "ModelLoadError: tiny-Q4_0.gguf: its sha256 is" in line and "the file was deleted" in line
    blobs = tmp_path / "hf" / "hub" / f"models--{REPO.replace('/', '--')}" / "blobs"
    assert not [p for p in blobs.iterdir() if not p.name.endswith(".incomplete")]


@pytest.mark.parametrize(
    "name, message",
    [
        (f"hf:{REPO}:Q2_K", f"hf:{REPO} has no Q2_K file; it has Q4_0, Q8_0"),
        ("hf:nobody/nothing", "hf:nobody/nothing: no such repository on http://127.0.0.1:"),
        (f"hf:{REPO}/missing.gguf", f"hf:{REPO} has no file missing.gguf"),
    ],
)
def test_names_that_cannot_be_pulled_say_why(hub, tmp_path, name, message):
    status, line = pull_error(name, {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf")})
    assert status == 1 and message in line, line


def test_without_the_hub_a_former_pull_is_served_from_the_cache(hub, tmp_path):
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf")}
    assert pull_error(f"hf:{REPO}:Q4_0", env)[0] == 0
    offline = {**env, "HF_ENDPOINT": "http://127.0.0.1:9"}  # nothing listens there
    assert pull_error(f"hf:{REPO}:Q4_0", offline)[0] == 0
    status, line = pull_error(f"hf:{REPO}:Q8_0", offline)  # never pulled
    assert status == 1 and "cannot reach http://127.0.0.1:9" in line


def test_a_split_model_is_fetched_part_by_part_and_joined_once(hub, tmp_path):
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf")}
    code = f"from webapp.engine.serving.hub_pull import pull; print(pull('hf:{SPLIT_REPO}:q4_0').model)"
    for _ in range(2):  # the second time: every part in the cache, the joined file too
        done = subprocess.run(
            [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, cwd=ROOT, timeout=120
        )
        assert done.returncode == 0, done.stderr[-2000:]
    joined = done.stdout.strip().splitlines()[-1]
    assert joined.endswith(os.path.join("joined", "0123456789abcdef0123456789abcdef01234567", "Q4_0", "tiny-Q4_0.gguf"))
    assert sorted(n for n in hub.served if n.startswith("Q4_0/")) == [f"Q4_0/tiny-Q4_0-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert all(hub.served[f"Q4_0/tiny-Q4_0-0000{i}-of-00003.gguf"] == 1 for i in (1, 2, 3))
    (want_kv, want), (got_kv, got) = read_gguf(hub.original), read_gguf(joined)
    assert got_kv == want_kv and [(t.ggml_type, t.shape) for t in got.values()] == [(t.ggml_type, t.shape) for t in want.values()]

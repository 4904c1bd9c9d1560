"""The model set's bookkeeping on real engines over fake runners (support.fakes.FakeRunner): which
model a name finds, least recently used first under the budget, busy models never unloaded, a
failed load not retried until its file changes, and LLM_MEMORY_BUDGET's sizes."""

from __future__ import annotations

import threading

import pytest
from support.fakes import FakeModelEngines

from webapp import create_app
from webapp.engine.serving.errors import EngineNotReady
from webapp.engine.serving.model_set import ModelNotFound, ModelsBusy, ModelSet
from webapp.engine.serving.settings import byte_size, engine_settings


def _files(folder, *names, size=100):
    for name in names:
        (folder / f"{name}.gguf").write_bytes(b"x" * size)
    return str(folder)


@pytest.fixture
def factory():
    return FakeModelEngines()


@pytest.fixture
def models_of(factory):
    made = []

    def build(folder, budget=None, **kw):
        models = ModelSet(str(folder), factory, budget, **kw)
        made.append(models)
        return models

    yield build
    for models in made:
        models.stop(5)


def _use(models, name):
    lease = models.lease(name)
    lease.release()
    return lease.engine


def _loaded(models) -> list[str]:
    return [m["id"] for m in models.listing() if m["loaded"]]


def test_the_least_recently_used_idle_model_is_unloaded_first(tmp_path, models_of):
    # footprint: 100 bytes of file + (1 slot + 1) x 64 positions x 1 byte of KV = 228 each
    models = models_of(_files(tmp_path, "a", "b", "c"), budget=2 * 228)
    first_a = _use(models, "a")
    _use(models, "b")
    assert _use(models, "a") is first_a  # still loaded: the same engine
    _use(models, "c")  # b is the least recently used
    assert _loaded(models) == ["a", "c"]
    assert [m.get("memory_bytes") for m in models.listing()] == [228, None, 228]
    assert first_a.state == "ok"


def test_a_busy_model_is_never_unloaded_the_load_waits_for_it_or_gets_models_busy(tmp_path, models_of):
    models = models_of(_files(tmp_path, "a", "b"), budget=228, wait_s=0.2)
    held = models.lease("a")
    with pytest.raises(ModelsBusy):
        models.lease("b")
    assert _loaded(models) == ["a"]

    models.wait_s = 30
    got = {}
    waiting = threading.Thread(target=lambda: got.update(lease=models.lease("b")))
    waiting.start()
    waiting.join(0.3)
    assert waiting.is_alive()  # waits for a's request to finish
    held.release()
    waiting.join(10)
    assert got["lease"].engine.state == "ok" and _loaded(models) == ["b"]
    assert held.engine.settled.is_set() and not held.engine._thread.is_alive()  # a's thread has ended
    got["lease"].release()


def test_loads_run_one_at_a_time_and_every_waiter_gets_the_engine(tmp_path, models_of, factory):
    models = models_of(_files(tmp_path, "a", "b"))
    factory.held[str(tmp_path / "a.gguf")] = gate = threading.Event()
    leases = {}
    asking = [threading.Thread(target=lambda n=n, i=i: leases.update({(n, i): models.lease(n)})) for n in "ab" for i in range(2)]
    for thread in asking[:2]:
        thread.start()
    for _ in range(200):  # a's load has begun before b is asked for, whichever thread runs first
        if factory.made:
            break
        threading.Event().wait(0.01)
    for thread in asking[2:]:
        thread.start()
    asking[-1].join(0.3)
    assert factory.made == [str(tmp_path / "a.gguf")]  # b waits for a's load to end
    assert [m["status"] for m in models.listing()] == ["loading", "unloaded"]
    gate.set()
    for thread in asking:
        thread.join(10)
    assert len(leases) == 4 and factory.made == [str(tmp_path / n) + ".gguf" for n in "ab"]
    assert leases[("a", 0)].engine is leases[("a", 1)].engine and leases[("b", 0)].engine is leases[("b", 1)].engine
    assert [m["running"] for m in models.listing()] == [2, 2]
    for lease in leases.values():
        lease.release()
        lease.release()  # once only
    assert [m["running"] for m in models.listing()] == [0, 0]


def test_the_api_answers_503_model_busy_with_retry_after_when_no_model_can_go(tmp_path, models_of):
    models = models_of(_files(tmp_path, "a", "b"), budget=228, wait_s=0.1)
    client = create_app({"TESTING": True}, engine=models).test_client()

    def ask(model):
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        with client.post("/v1/chat/completions", json=body) as response:  # closed: the model is let go
            return response.status_code, response.headers, response.json

    assert ask("a")[0] == 200
    held = models.lease("a")  # a request still running on a
    status, headers, body = ask("b")
    assert status == 503 and headers["Retry-After"] == "10"
    assert body["error"]["code"] == "model_busy" and body["error"]["param"] == "model"
    held.release()
    assert ask("b")[0] == 200 and _loaded(models) == ["b"]


def test_names_are_only_matched_against_the_listing(tmp_path, models_of, factory):
    folder = tmp_path / "models"
    folder.mkdir()
    _files(folder, "a")
    _files(tmp_path, "outside")
    (folder / "a.txt").write_text("x")
    (folder / "dir.gguf").mkdir()
    models = models_of(folder)
    for name in ("../outside", "outside", str(tmp_path / "outside.gguf"), "a.gguf", "a.txt", "dir", "", "./a"):
        with pytest.raises(ModelNotFound):
            models.lease(name)
    assert factory.made == []
    assert [f.name for f in models.files()] == ["a"]
    assert models.lease(None).engine is models.lease("a").engine  # no name: the first model


def test_llm_model_is_listed_first_loaded_at_start_and_is_the_default(tmp_path, models_of, factory):
    folder = tmp_path / "models"
    folder.mkdir()
    _files(folder, "a", "z")
    first = _files(tmp_path, "main") + "/main.gguf"
    models = models_of(folder, first=first).start()
    assert [m["id"] for m in models.listing()] == ["main", "a", "z"]
    assert factory.made == [first]
    assert models.lease(None).engine is models.lease("main").engine


def test_a_failed_load_is_a_503_and_not_retried_until_the_file_changes(tmp_path, models_of, factory):
    models = models_of(_files(tmp_path, "bad"))
    factory.broken.add(str(tmp_path / "bad.gguf"))
    for _ in range(2):
        with pytest.raises(EngineNotReady, match="bad failed to load: ValueError: not a GGUF"):
            models.lease("bad")
    assert len(factory.made) == 1 and models.listing()[0]["status"] == "failed"
    assert models.health()["status"] == "ok"  # other models still serve
    factory.broken.clear()
    _files(tmp_path, "bad", size=101)  # a new file: tried again
    assert _use(models, "bad").state == "ok" and len(factory.made) == 2


def test_the_api_answers_a_failed_load_with_503_model_load_failed_and_no_retry_after(tmp_path, models_of, factory):
    """Waiting will not mend a broken file: no Retry-After for clients (the openai SDK honours it),
    a code of its own, and Anthropic's shape on its route."""
    models = models_of(_files(tmp_path, "bad"))
    factory.broken.add(str(tmp_path / "bad.gguf"))
    client = create_app({"TESTING": True}, engine=models).test_client()
    chat = {"model": "bad", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    response = client.post("/v1/chat/completions", json=chat)
    assert response.status_code == 503 and "Retry-After" not in response.headers
    assert response.json["error"]["code"] == "model_load_failed"
    assert response.json["error"]["message"] == "the model bad failed to load: ValueError: not a GGUF"
    response = client.post("/v1/messages", json=chat)
    assert response.status_code == 503 and "Retry-After" not in response.headers
    assert response.json["type"] == "error" and "bad failed to load" in response.json["error"]["message"]


def test_abort_and_stop_reach_every_engine(tmp_path, models_of):
    models = models_of(_files(tmp_path, "a", "b"))
    engines = [_use(models, "a"), _use(models, "b")]
    models.stop(5)
    assert all(not e._thread.is_alive() for e in engines)
    with pytest.raises(EngineNotReady):
        models.lease("a")


def test_memory_budget_sizes():
    assert byte_size(1000, "MEMORY_BUDGET") == 1000
    assert byte_size("8G", "MEMORY_BUDGET") == 8 << 30
    assert byte_size("512M", "MEMORY_BUDGET") == 512 << 20
    assert byte_size("1.5GiB", "MEMORY_BUDGET") == 3 << 29
    for bad in ("8X", "-1", "G", True):
        with pytest.raises(ValueError, match="LLM_MEMORY_BUDGET"):
            byte_size(bad, "MEMORY_BUDGET")


def test_settings_of_a_model_set(tmp_path):
    s = engine_settings({"MODELS_DIR": str(tmp_path), "MEMORY_BUDGET": "2G"})
    assert s.path is None and s.models_dir == str(tmp_path) and s.memory_budget == 2 << 30
    with pytest.raises(FileNotFoundError, match="LLM_MODELS_DIR"):
        engine_settings({"MODELS_DIR": str(tmp_path / "missing")})
    from webapp.engine.serving.loader import build_engine

    assert isinstance(build_engine({"MODELS_DIR": str(tmp_path)}), ModelSet)  # nothing loads until started


def test_an_idle_model_sleeps_and_the_next_request_wakes_it(tmp_path, models_of):
    from support.fakes import Clock

    clock = Clock()
    models = models_of(_files(tmp_path, "a", "b"), idle_s=10, clock=clock)
    first = _use(models, "a")
    _use(models, "b")
    clock.now += 5
    _use(models, "b")
    clock.now += 6  # a: idle 11 s, b: 6 s
    assert models.sleep_idle() == ["a"] and _loaded(models) == ["b"]
    assert {m["id"]: m["status"] for m in models.listing()} == {"a": "unloaded", "b": "loaded"}
    assert _use(models, "a") is not first  # loaded again
    held = models.lease("b")
    clock.now += 60
    assert models.sleep_idle() == ["a"] and _loaded(models) == ["b"]  # a held model never sleeps
    held.release()


def test_a_requests_keep_alive_sets_its_models_idle_time(tmp_path, models_of):
    from support.fakes import Clock

    clock = Clock()
    models = models_of(_files(tmp_path, "a", "b"), idle_s=10, clock=clock)
    models.lease("a", keep_alive=0).release()  # Ollama's keep_alive 0: asleep once the request ends
    assert _loaded(models) == []
    models.lease("a", keep_alive=-1).release()  # negative: kept loaded
    models.lease("b", keep_alive=30).release()
    clock.now += 20
    assert models.sleep_idle() == [] and _loaded(models) == ["a", "b"]
    clock.now += 20
    assert models.sleep_idle() == ["b"]


def test_a_single_model_is_a_set_of_one_without_a_folder(tmp_path, factory):
    path = _files(tmp_path, "only") + "/only.gguf"
    models = ModelSet(None, factory, first=path, idle_s=0.05).start()
    try:
        assert [f.name for f in models.files()] == ["only"]
        _use(models, "only")
        deadline = threading.Event()
        for _ in range(100):  # the sleeper thread unloads it
            if not _loaded(models):
                break
            deadline.wait(0.02)
        assert _loaded(models) == []
        assert _use(models, None).state == "ok" and _loaded(models) == ["only"]
        assert _use(models, "gpt-4o").state == "ok"  # any name, as a single model answers
    finally:
        models.stop(5)


def test_idle_unload_seconds_setting(tmp_path):
    path = _files(tmp_path, "m") + "/m.gguf"
    assert engine_settings({"MODEL": path}).idle_unload is None
    assert engine_settings({"MODEL": path, "IDLE_UNLOAD_SECONDS": "300"}).idle_unload == 300.0
    for bad in ("0", "-5", "soon"):
        with pytest.raises(ValueError, match="LLM_IDLE_UNLOAD_SECONDS"):
            engine_settings({"MODEL": path, "IDLE_UNLOAD_SECONDS": bad})


def test_image_token_settings(tmp_path):
    path = _files(tmp_path, "m") + "/m.gguf"
    assert engine_settings({"MODEL": path}).image_tokens == (None, None)
    assert engine_settings({"MODEL": path, "IMAGE_MAX_TOKENS": "256"}).image_tokens == (None, 256)
    for bad in ("0", "-3", "many"):
        with pytest.raises(ValueError, match="LLM_IMAGE_MIN_TOKENS"):
            engine_settings({"MODEL": path, "IMAGE_MIN_TOKENS": bad})


def test_adapters_loaded_at_run_time_count_against_the_budget(tmp_path, models_of):
    """A model's LoRA adapters count in its footprint as they are now: one loaded after the model
    (vLLM's /v1/load_lora_adapter) makes the next load unload what it must to fit."""
    from types import SimpleNamespace

    models = models_of(_files(tmp_path, "a", "b"), budget=2 * 228 + 148)  # a, b and c (138) fit, with 10 to spare
    a = _use(models, "a")
    _use(models, "b")
    assert _loaded(models) == ["a", "b"] and [m["memory_bytes"] for m in models.listing()] == [228, 228]
    a.loaded.adapters = SimpleNamespace(nbytes=50)  # an adapter loaded into a at run time
    assert [m["memory_bytes"] for m in models.listing()] == [278, 228]
    (tmp_path / "c.gguf").write_bytes(b"x" * 10)  # a small model: 138 bytes with its cache
    _use(models, "c")  # but 278 + 228 + 138 is over it: a, the least recently used, goes
    assert _loaded(models) == ["b", "c"]

"""Several models in one server (LLM_MODELS_DIR): two tiny random-weight llamas served by one process
through the real `openai` client and a real Waitress server, each on its own engine and model thread.

Under a budget that holds one of them, asking for the other unloads the least recently used, and
asking for it again reloads it with the same greedy output; a name outside the folder's listing is a
404 in the API's own shape and opens nothing; `/health` stays 200 while a model loads, and a loaded
model's stream runs on while another loads beside it."""

from __future__ import annotations

import contextlib
import os
import threading

import openai
import pytest
from support import TINY_CONTEXT, get, metric_families, post, running_server, slowed_decode, wait_until
from support.tiny_models import write_tiny_gguf

from webapp import create_app
from webapp.engine.serving.model_set import ModelSet

SLOTS, CHUNK = 2, 8


def _engine_factory(gates: dict[str, threading.Event]):
    """The loader's own engines (loader.build_engine's, on the real GGUF loader), each load held
    until its model's gate opens; `opened` records every path an engine was made for."""
    from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread
    from webapp.engine.serving.engine import Engine
    from webapp.engine.serving.loader import load_gguf_model

    opened: list[str] = []

    def make_engine(path: str) -> Engine:
        opened.append(path)

        def load():
            gates.setdefault(path, threading.Event()).wait(60)
            use_tinygrad_from_this_thread()
            return load_gguf_model(path, SLOTS, TINY_CONTEXT, CHUNK)

        return Engine(load, slots=SLOTS, queue_limit=2, prefill_chunk=CHUNK)

    return make_engine, opened


@contextlib.contextmanager
def model_set_server(folder: str, budget: int | None, **config):
    gates: dict[str, threading.Event] = {}
    make_engine, opened = _engine_factory(gates)
    models = ModelSet(folder, make_engine, budget).start()
    app = create_app({"TESTING": True, **config}, engine=models)
    try:
        with running_server(app, threads=16) as srv:
            srv.app, srv.models, srv.gates, srv.opened = app, models, gates, opened
            srv.client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
            yield srv
            srv.client.close()
    finally:
        models.stop(5)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    models = root / "models"
    models.mkdir()
    write_tiny_gguf(str(models / "alpha.gguf"), "llama", context=TINY_CONTEXT, seed=1)
    write_tiny_gguf(str(models / "beta.gguf"), "llama", context=TINY_CONTEXT, seed=2, n_layers=3)
    write_tiny_gguf(str(root / "outside.gguf"), "llama", context=TINY_CONTEXT, seed=3)
    (models / "notes.txt").write_text("not a model")
    return str(models)


def _listed(srv) -> dict[str, dict]:
    return {m.id: m.model_dump() for m in srv.client.models.list().data}


def _open(srv, *names):
    for name in names:
        srv.gates.setdefault(os.path.join(srv.models.folder, f"{name}.gguf"), threading.Event()).set()


def _greedy(srv, model: str) -> str:
    reply = srv.client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0)
    assert reply.model == model
    return reply.choices[0].message.content


def test_two_models_one_budget_lru_unloaded_and_reloaded_with_the_same_output(folder):
    sizes = {n: os.path.getsize(os.path.join(folder, f"{n}.gguf")) for n in ("alpha", "beta")}
    # room for either model's weights and cache, not for both
    with model_set_server(folder, budget=sizes["alpha"] + sizes["beta"] - 1) as srv:
        _open(srv, "alpha", "beta")
        listed = _listed(srv)
        assert list(listed) == ["alpha", "beta"]  # by name; notes.txt and outside.gguf are not models here
        for name, model in listed.items():
            assert model["object"] == "model" and model["owned_by"] == "local" and model["created"] > 0
            assert model["size"] == sizes[name] and model["loaded"] is False and model["status"] == "unloaded"

        alpha = _greedy(srv, "alpha")
        assert {n: m["loaded"] for n, m in _listed(srv).items()} == {"alpha": True, "beta": False}
        beta = _greedy(srv, "beta")
        assert beta != alpha  # another model's weights
        assert {n: m["loaded"] for n, m in _listed(srv).items()} == {"alpha": False, "beta": True}  # alpha was the LRU
        assert _greedy(srv, "alpha") == alpha  # reloaded on demand: the same greedy tokens
        assert {n: m["loaded"] for n, m in _listed(srv).items()} == {"alpha": True, "beta": False}

        # every endpoint with a model field routes through the same lookup
        embedded = srv.client.embeddings.create(model="beta", input="hello")
        assert embedded.model == "beta" and len(embedded.data[0].embedding) == 64
        status, _, body = post(srv, "/v1/completions", {"model": "alpha", "prompt": "hi", "max_tokens": 2})
        assert status == 200 and body["model"] == "alpha"
        status, _, body = post(srv, "/v1/messages", {"model": "beta", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert status == 200 and body["model"] == "beta"
        chunks = list(
            srv.client.chat.completions.create(model="beta", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True)
        )
        assert chunks[-1].choices[0].finish_reason == "length" and {c.model for c in chunks} == {"beta"}
        assert post(srv, "/v1/chat/completions", {"model": "beta", "messages": [], "max_tokens": 2})[0] == 400
        # every request let go of its model: a refused one, a stream, the rest
        assert wait_until(lambda: [m.get("running") for m in srv.models.listing()] == [None, 0])


@pytest.mark.parametrize("name", ["nope", "../outside", "outside", "alpha.gguf", "../models/alpha", "/abs/alpha", "notes.txt"])
def test_a_name_outside_the_listing_is_a_404_and_opens_nothing(folder, name):
    with model_set_server(folder, budget=None) as srv:
        with pytest.raises(openai.NotFoundError) as caught:
            srv.client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert caught.value.code == "model_not_found" and caught.value.body["param"] == "model"
        # Anthropic's endpoint answers in Anthropic's shape
        status, _, body = post(srv, "/v1/messages", {"model": name, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert status == 404 and body["type"] == "error" and body["error"]["type"] == "not_found_error"
        status, _, body = post(srv, "/v1/embeddings", {"model": name, "input": "hi"})
        assert status == 404 and body["error"]["code"] == "model_not_found"
        assert srv.opened == []  # no engine was made, no file opened


def test_health_stays_200_while_a_model_loads(folder):
    with model_set_server(folder, budget=None) as srv:
        reply: dict = {}
        asking = threading.Thread(target=lambda: reply.update(text=_greedy(srv, "beta")))
        asking.start()  # its load is held at the gate
        assert wait_until(lambda: _listed(srv)["beta"]["status"] == "loading")
        status, _, body = get(srv, "/health")
        assert status == 200 and body["status"] == "ok" and body["models"] == {"alpha": "unloaded", "beta": "loading"}
        _open(srv, "beta")
        asking.join(120)
        assert reply["text"] and _listed(srv)["beta"]["loaded"] is True
        assert get(srv, "/health")[0] == 200


def test_metrics_and_the_dashboard_are_per_model(folder):
    with model_set_server(folder, budget=None, METRICS_COMPAT="vllm") as srv:
        _open(srv, "alpha", "beta")
        _greedy(srv, "alpha")
        _greedy(srv, "beta")  # the most recently used: the dashboard's default
        families = metric_families(srv.app.test_client())
        slots = {s.labels["model"]: s.value for s in families["llm_num_slots"].samples}
        assert slots == {"alpha": SLOTS, "beta": SLOTS}
        ready = {s.labels["model"]: s.value for s in families["llm_engine_ready"].samples}
        assert ready == {"alpha": 1.0, "beta": 1.0}
        generated = {s.labels["model"]: s.value for s in families["llm_generation_tokens"].samples}
        assert generated["alpha"] > 0 and generated["beta"] > 0
        finished = [s for s in families["llm_requests"].samples if s.labels["finish_reason"] == "length"]
        assert {s.labels["model"]: s.value for s in finished} == {"alpha": 1, "beta": 1}
        running = {s.labels["model_name"]: s.value for s in families["vllm:num_requests_running"].samples}
        assert running == {"alpha": 0, "beta": 0}

        status, _, stats = get(srv, "/admin/stats.json")
        assert status == 200 and stats["model"] == "beta"
        assert [(m["id"], m["status"], m["running"]) for m in stats["models"]] == [("alpha", "loaded", 0), ("beta", "loaded", 0)]
        assert get(srv, "/admin/stats.json?model=alpha")[2]["model"] == "alpha"
        page = srv.app.test_client().get("/admin?model=alpha").get_data(as_text=True)
        assert "<h2>Models</h2>" in page and 'href="?model=beta"' in page and "ms-loaded" in page


def test_a_model_streams_on_while_another_loads_beside_it(folder):
    with model_set_server(folder, budget=None) as srv:
        _open(srv, "alpha")
        alone = {"alpha": _greedy(srv, "alpha")}
        lease = srv.models.lease("alpha")
        lease.release()
        alpha = lease.engine
        long = {"model": "alpha", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 48, "temperature": 0}
        with slowed_decode(alpha, 0.1):  # ~5 s of decoding
            stream = srv.client.chat.completions.create(**long, stream=True)
            chunks = [next(stream), next(stream)]  # alpha is decoding...
            loading = threading.Thread(target=lambda: alone.update(beta=_greedy(srv, "beta")))
            loading.start()
            assert wait_until(lambda: _listed(srv)["beta"]["status"] == "loading")
            _open(srv, "beta")  # ...while beta loads, warms up and answers on its own model thread
            loading.join(120)
            assert alpha.stats()["running"] == 1  # alpha's stream was running all along
            chunks += list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text.startswith(alone["alpha"]) and alone["beta"]
    with model_set_server(folder, budget=None) as fresh:  # beta alone, in a server of its own
        _open(fresh, "beta")
        assert _greedy(fresh, "beta") == alone["beta"]

"""The chat page and the dashboard in a real (headless Debian) Chromium, driven by Playwright, against
the real engine on a tiny random GGUF behind Waitress: a reply streams in, Stop frees the slot, the
dashboard follows a request live, user text stays text, no console errors; and /admin answers in
under a second while every slot and the queue are busy. Screenshots land in test-output/.

Skipped when Playwright or /usr/bin/chromium is missing (`playwright install` is never needed).
"""

import json
import os
import threading
import time
import urllib.request

import pytest
from support import (
    CHROMIUM,
    DESKTOP,
    PHONE,
    SHOTS,
    TINY_QUEUE_LIMIT,
    TINY_SLOTS,
    axe_violations,
    before_each_decode,
    get,
    post,
    send_message,
    slowed_decode,
    wait_until,
)

pytest.importorskip("playwright.sync_api")
if not os.path.exists(CHROMIUM):
    pytest.skip(f"no Chromium at {CHROMIUM}", allow_module_level=True)

SLOTS, QUEUE_LIMIT = TINY_SLOTS, TINY_QUEUE_LIMIT


@pytest.fixture
def slow_replies(tiny_llama_server):
    """Stretch tiny-model steps so a reply lasts long enough to watch and stop."""
    engine, srv = tiny_llama_server
    with slowed_decode(engine, 0.06):
        yield
    assert wait_until(lambda: stats(srv)["running"] == 0)


def stats(srv) -> dict:
    return get(srv, "/admin/stats.json", timeout=5)[2]


def open_chat(pages, srv, max_tokens: int):
    page = pages(srv.url + "/")
    page.wait_for_function("() => document.getElementById('model-name').textContent === 'tiny-llama'")
    page.click("#settings summary")
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#temperature", "0")
    page.click("#settings summary")  # fold the panel away again
    return page


# Predicates are functions, not expressions: the pages' CSP forbids eval, which expressions need.
STREAMING = "() => { const c = document.querySelector('.msg.assistant.pending .content'); return c && c.textContent.length > 0; }"
LAST_META = "document.querySelector('.msg.assistant:last-of-type .meta').textContent"


def test_chat_streams_replies_and_keeps_user_text_as_text(pages, tiny_llama_server, slow_replies):
    _, srv = tiny_llama_server
    page = open_chat(pages, srv, max_tokens=24)
    send_message(page, "<b>bold?</b> Tell me about cats.")
    # text shows up while the reply is still streaming
    page.wait_for_function(STREAMING, timeout=10_000)
    assert page.is_visible("#stop") and not page.is_visible("#send")
    page.wait_for_function(f"() => {LAST_META}.includes('tok/s')", timeout=15_000)
    meta = page.eval_on_selector(".msg.assistant .meta", "e => e.textContent")
    assert "24 tokens" in meta and "cut off at the token limit" in meta and "first token" in meta
    assert page.inner_text(".msg.user .content") == "<b>bold?</b> Tell me about cats."
    assert page.locator("#log b").count() == 0  # typed markup is text, not an element
    assert page.is_visible("#send") and not page.is_visible("#stop")

    # a second turn carries the history: the first turn comes back out of the KV cache
    send_message(page, "And dogs?")
    page.wait_for_function("() => document.querySelectorAll('.msg.assistant .meta').length === 2 && "
                           "[...document.querySelectorAll('.msg.assistant .meta')].every(m => m.textContent)", timeout=15_000)  # fmt: skip
    assert "prompt tokens cached" in page.eval_on_selector_all(".msg.assistant .meta", "ms => ms[1].textContent")
    second_turn_cached = stats(srv)["recent_requests"][0]["cached_tokens"]
    assert second_turn_cached > 20

    # Regenerate asks again for the same messages: now the second turn's prompt is cached too
    page.click(".msg.assistant:last-of-type button[data-action=regenerate]")
    page.wait_for_function(f"() => {LAST_META}.includes('prompt tokens cached')", timeout=15_000)
    assert page.locator(".msg").count() == 4
    assert stats(srv)["recent_requests"][0]["cached_tokens"] > second_turn_cached

    SHOTS.mkdir(exist_ok=True)
    page.screenshot(path=str(SHOTS / "chat-desktop.png"))
    page.set_viewport_size(PHONE)
    page.screenshot(path=str(SHOTS / "chat-phone.png"))
    page.emulate_media(color_scheme="dark")
    page.click("#settings summary")
    page.screenshot(path=str(SHOTS / "chat-phone-dark-settings.png"))

    page.set_viewport_size(DESKTOP)  # where the side list with New chat is always shown
    page.click("#new-chat")
    assert page.locator(".msg").count() == 0 and page.is_visible("#empty")


def test_stop_frees_the_slot(pages, tiny_llama_server, slow_replies):
    _, srv = tiny_llama_server
    before = stats(srv)["requests_total"]["cancelled"]
    page = open_chat(pages, srv, max_tokens=400)
    send_message(page, "Go on for a long time.")
    page.wait_for_function(STREAMING, timeout=10_000)
    assert stats(srv)["running"] == 1
    page.click("#stop")
    assert wait_until(lambda: stats(srv)["running"] == 0, timeout=5), stats(srv)["slots"]
    assert stats(srv)["requests_total"]["cancelled"] == before + 1
    page.wait_for_function(f"() => {LAST_META}.startsWith('stopped')")
    assert page.is_visible("#send")


def test_dashboard_follows_a_request_live(pages, tiny_llama_server, slow_replies):
    _, srv = tiny_llama_server
    chat = open_chat(pages, srv, max_tokens=400)
    admin = pages(srv.url + "/admin")
    admin.wait_for_selector("#live.ok")
    tile = "document.querySelector('.tile [data-stat=running]').textContent"
    assert admin.evaluate(f"() => {tile}") == "0"
    send_message(chat, "Write a long poem.")
    admin.wait_for_function(f"() => {tile} === '1'", timeout=5_000)
    generated = "document.querySelector('[data-stat=generated_tokens_total]').textContent"
    first = admin.evaluate(f"() => {generated}")
    admin.wait_for_function(f"() => {generated} !== {json.dumps(first)}", timeout=5_000)  # the numbers move
    admin.wait_for_function("() => document.querySelector('[data-stat=decode_tokens_per_s]').textContent !== '0.0'")
    assert admin.locator("#slot-rows .st-decode").count() == 1
    assert admin.locator("#slot-rows rect.kv-generated").count() == 1
    # the decode plot has drawn a point above zero (y < 100 in the SVG's units)
    admin.wait_for_function(
        "() => { const d = document.querySelector('[data-plot=tokens] path.line[data-series=decode_tokens_per_s]').getAttribute('d');"
        " return d && Math.min(...d.match(/,[\\d.]+/g).map(s => +s.slice(1))) < 100; }",
        timeout=5_000,
    )
    SHOTS.mkdir(exist_ok=True)
    admin.screenshot(path=str(SHOTS / "admin-desktop.png"), full_page=True)
    admin.set_viewport_size(PHONE)
    admin.screenshot(path=str(SHOTS / "admin-phone.png"), full_page=True)
    admin.set_viewport_size(DESKTOP)
    admin.emulate_media(color_scheme="dark")
    admin.screenshot(path=str(SHOTS / "admin-desktop-dark.png"))
    chat.click("#stop")
    admin.wait_for_function(f"() => {tile} === '0'", timeout=5_000)
    assert admin.locator("#recent-rows .fr-cancelled").count() >= 1


def test_dashboard_without_javascript(browser, tiny_llama_server):
    _, srv = tiny_llama_server
    context = browser.new_context(java_script_enabled=False, viewport=DESKTOP)
    page = context.new_page()
    page.goto(srv.url + "/admin")
    assert page.inner_text(".tile [data-stat=slots_total]") == str(SLOTS)
    assert page.inner_text("[data-stat=model]") == "tiny-llama"
    assert page.locator("#slot-rows tr").count() == SLOTS
    assert page.locator("[data-plot=running] path.line").get_attribute("d").startswith("M")
    context.close()


def test_errors_are_shown_clearly(pages, tiny_llama_server):
    _, srv = tiny_llama_server
    page = open_chat(pages, srv, max_tokens=4)
    # a prompt longer than the whole context: the server's real 400
    pages.expected.append("status of 400")
    send_message(page, "cat " * 300)
    page.wait_for_selector("#error:not([hidden])")
    assert "too long for the model" in page.inner_text("#error")
    assert page.input_value("#input").startswith("cat cat")  # given back to edit
    assert page.locator(".msg").count() == 0
    assert page.locator("#conversations li").count() == 0  # and nothing of it stays saved
    # a full server (faked at the network layer: filling the real queue is the next test's job)
    pages.expected.append("status of 429")
    body = {"error": {"message": "Too many requests are waiting.", "type": "rate_limit_exceeded", "param": None, "code": "queue_full"}}
    page.route("**/v1/chat/completions", lambda route: route.fulfill(status=429, headers={"Retry-After": "7"}, json=body))
    send_message(page, "hello")
    page.wait_for_function("() => document.getElementById('notice').textContent.includes('busy')")
    assert "Trying again in 7 s" in page.inner_text("#notice")  # and it will, on its own
    SHOTS.mkdir(exist_ok=True)
    page.screenshot(path=str(SHOTS / "chat-error.png"))


def test_dashboard_has_no_serious_accessibility_violations(pages, tiny_llama_server):
    _, srv = tiny_llama_server
    page = pages(srv.url + "/admin")
    page.wait_for_selector("#live.ok")
    assert axe_violations(page) == []
    page.emulate_media(color_scheme="dark")
    assert axe_violations(page) == []


def timed_get(url) -> float:
    started = time.monotonic()
    with urllib.request.urlopen(url, timeout=5) as r:
        assert r.status == 200
        r.read()
    return time.monotonic() - started


def test_admin_answers_within_a_second_when_every_slot_and_the_queue_are_busy(browser, tiny_llama_server):
    engine, srv = tiny_llama_server
    gate = threading.Event()

    def stall_once_full(batch):
        # stall only once every slot is decoding: a request arriving mid-stall would never be admitted
        if len(batch) == SLOTS:
            gate.wait(30)
        else:
            time.sleep(0.05)  # keep the early requests running until the others arrive

    def ask(i):
        # ignore_eos: a random tiny model may otherwise end a request before every slot is taken
        body = {"messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 40, "ignore_eos": True}
        post(srv, "/v1/chat/completions", body, timeout=60)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(SLOTS + QUEUE_LIMIT)]
    try:
        with before_each_decode(engine, stall_once_full):
            try:
                for t in threads[:SLOTS]:
                    t.start()
                assert wait_until(lambda: stats(srv)["running"] == SLOTS)
                for t in threads[SLOTS:]:
                    t.start()
                assert wait_until(lambda: stats(srv)["queue_depth"] == QUEUE_LIMIT)
                paths = ("/admin", "/admin/stats.json", "/metrics")
                timings = {path: max(timed_get(srv.url + path) for _ in range(5)) for path in paths}
                page = browser.new_page(viewport=DESKTOP)
                started = time.monotonic()
                page.goto(srv.url + "/admin")
                page.wait_for_selector("#live.ok")
                timings["browser: /admin loaded and first poll"] = time.monotonic() - started
                assert page.inner_text(".tile [data-stat=queue_depth]") == str(QUEUE_LIMIT)
                assert page.inner_text(".tile [data-stat=running]") == str(SLOTS)
                page.close()
                SHOTS.mkdir(exist_ok=True)
                (SHOTS / "admin-latency-under-load.txt").write_text("".join(f"{k}: {v * 1000:.1f} ms\n" for k, v in timings.items()))
                assert all(t < 1.0 for t in timings.values()), timings
            finally:
                gate.set()
    finally:
        for t in threads:
            if t.ident is not None:
                t.join(30)
    assert wait_until(lambda: stats(srv)["running"] == 0 and stats(srv)["queue_depth"] == 0)


def test_dashboard_draws_a_mixture_of_experts_load_live(pages, tmp_path):
    """A qwen3moe file: the Experts panel has a bar an expert, and the live page redraws them (and
    their figures) as requests route tokens to experts."""
    from support import tiny_engine_server
    from support.tiny_models import write_tiny_gguf

    path = write_tiny_gguf(str(tmp_path / "tiny-moe.gguf"), "qwen3moe", experts=(16, 2, 32), matrix_type="Q8_0")
    with tiny_engine_server(path, slots=2, queue_limit=2) as (_, srv):
        page = pages(srv.url + "/admin")
        assert page.locator("#expert-bars rect").count() == 16
        before = page.locator("[data-stat='experts.mean_per_step']").text_content()
        post(srv, "/v1/completions", {"prompt": "Mixture of experts", "max_tokens": 6, "temperature": 0})
        page.wait_for_function(
            "(before) => document.querySelector(\"[data-stat='experts.mean_per_step']\").textContent !== before", arg=before
        )
        assert page.locator("#expert-bars rect").count() == 16
        heights = [float(h) for h in page.eval_on_selector_all("#expert-bars rect", "bars => bars.map(b => b.getAttribute('height'))")]
        assert max(heights) == 40 and min(heights) >= 0
        page.locator("#experts").screenshot(path=str(SHOTS / "dashboard-experts.png"))
        page.screenshot(path=str(SHOTS / "dashboard-moe.png"), full_page=True)

"""The chat page's features in Debian's Chromium, against a real engine over a scripted runner behind a
real Waitress server: markdown rendered while streaming, hostile text that runs nothing, conversations
saved in the browser (reload, rename, search, delete, export, import), regenerate and edit with the
cached-token figure, copying, reasoning and JSON blocks, retry on a busy server, the keyboard, and
axe-core's audit. Screenshots of desktop and phone, light and dark, land in test-output/.

Skipped when Playwright or /usr/bin/chromium is missing.
"""

import json
import os

import pytest
from support import PHONE, SHOTS, axe_violations, send_message, wait_until
from support.fakes import BOS, Reply

pytest.importorskip("playwright.sync_api")

MARKDOWN = """## Cooking rice

Rinse it **well**, then use `1.5` cups of water per cup:

- long grain: 15 min
- brown: 40 min

| Rice | Water | Minutes |
|:-----|------:|--------:|
| White | 1.5 | 15 |
| Brown | 2 | 40 |

```python
def cook(rice: str, minutes: int = 15) -> str:
    return f"{rice} ready in {minutes} min"
```

More at [the rice guide](https://example.com/rice).
"""
CODE = 'def cook(rice: str, minutes: int = 15) -> str:\n    return f"{rice} ready in {minutes} min"'
HOSTILE = (
    "<img src=x onerror=\"fetch('/pwned-img')\"> <script>fetch('/pwned-script')</script>\n\n"
    "[x](javascript:fetch('/pwned-link')) ![y](/pwned-image.png)\n\n"
    "<svg onload=\"fetch('/pwned-svg')\"><script>fetch('/pwned-svg-script')</script></svg>\n\n"
    '<a href="javascript:alert(1)">click</a> <iframe src="/pwned-frame"></iframe>'
)
META = "document.querySelector('.msg.assistant:last-of-type .meta').textContent"
REPLY_DONE = f"() => document.querySelector('.msg.assistant:last-of-type:not(.pending)') && {META}.length > 0"


@pytest.fixture
def chat_page(pages, fake_server):
    pages.context.grant_permissions(["clipboard-read", "clipboard-write"])
    page = pages(fake_server.url + "/")
    page.wait_for_function("() => document.getElementById('model-name').textContent === 'fake-model'")
    yield page
    page.close()  # before the server stops under it: a poll then would be refused, a console error


def send_and_wait(page, text):
    send_message(page, text)
    page.wait_for_function(REPLY_DONE, timeout=30_000)


def clipboard(page) -> str:
    return page.evaluate("() => navigator.clipboard.readText()")


def test_markdown_renders_while_streaming_and_code_copies(chat_page, fake_runner):
    fake_runner.replies.append(Reply.text(MARKDOWN, delay=0.01))
    send_message(chat_page, "How do I cook rice?")
    # Blocks above the one still growing keep their nodes: nothing above it flickers or re-renders.
    chat_page.wait_for_function("() => document.querySelector('.msg.assistant.pending .content strong')")
    chat_page.evaluate("() => { window.heading = document.querySelector('.msg.assistant .content h2'); }")
    chat_page.wait_for_function(REPLY_DONE, timeout=15_000)
    assert chat_page.evaluate("() => window.heading === document.querySelector('.msg.assistant .content h2')")

    reply = chat_page.locator(".msg.assistant .content")
    assert reply.locator("h2").inner_text() == "Cooking rice"
    assert reply.locator("strong").inner_text() == "well"
    assert reply.locator("ul > li").count() == 2
    assert reply.locator("table tr").count() == 3
    assert reply.locator("td[align=right]").count() == 4
    assert reply.locator(".code-head span").inner_text() == "python"
    assert reply.locator("pre code .hljs-keyword").first.inner_text() == "def"  # highlighted
    link = reply.locator("a")
    assert link.get_attribute("href") == "https://example.com/rice"
    assert link.get_attribute("target") == "_blank" and "noopener" in link.get_attribute("rel")

    chat_page.click(".copy-code")
    assert clipboard(chat_page) == CODE
    assert chat_page.inner_text(".copy-code") == "Copied"
    chat_page.click(".msg.assistant button[data-action=copy]")
    assert clipboard(chat_page) == MARKDOWN  # a reply copies as the markdown the model wrote

    SHOTS.mkdir(exist_ok=True)
    for scheme in ("light", "dark"):
        chat_page.emulate_media(color_scheme=scheme)
        chat_page.set_viewport_size({"width": 1280, "height": 900})
        chat_page.screenshot(path=str(SHOTS / f"chat-markdown-desktop-{scheme}.png"))
        chat_page.set_viewport_size(PHONE)
        chat_page.screenshot(path=str(SHOTS / f"chat-markdown-phone-{scheme}.png"))
    chat_page.click("#open-sidebar")
    chat_page.screenshot(path=str(SHOTS / "chat-side-list-phone-dark.png"))


def test_hostile_text_runs_nothing(chat_page, fake_runner):
    dialogs, requests = [], []
    chat_page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    chat_page.on("request", lambda r: requests.append(r.url))
    fake_runner.replies.append(Reply.text(HOSTILE))
    send_and_wait(chat_page, HOSTILE)
    assert chat_page.inner_text(".msg.user .content") == HOSTILE  # the user's text, as text
    log = chat_page.locator("#log")
    assert log.locator("img, script, svg, iframe, [onerror], [onload]").count() == 0
    assert log.locator("a[href^='javascript' i]").count() == 0
    assert "<img src=x" in chat_page.inner_text(".msg.assistant .content")  # raw HTML shows as text
    # an image is a link the reader may follow, not a request the page makes on its own
    assert chat_page.get_attribute(".msg.assistant .content a:text-is('y')", "href") == "/pwned-image.png"
    chat_page.click(".msg.assistant .content a:text-is('x')")  # the javascript: link has lost its href
    chat_page.wait_for_timeout(300)
    assert dialogs == []
    assert not [u for u in requests if "pwned" in u], requests
    assert len(chat_page.context.pages) == 1


def conversation_titles(page) -> list[str]:
    return page.locator("#conversations .open").all_inner_texts()


def stored(page) -> list[dict]:
    return page.evaluate("() => JSON.parse(localStorage.getItem('chat.conversations.v1'))")


def test_conversations_survive_reload_and_export_then_import(chat_page, fake_runner, tmp_path):
    fake_runner.replies.extend([Reply.text("Paris is the capital."), Reply.text("Use `sorted()`.")])
    send_and_wait(chat_page, "Capital of France?")
    chat_page.click("#new-chat")
    send_and_wait(chat_page, "How do I sort a list?")
    chat_page.reload()
    chat_page.wait_for_selector("#conversations li")
    assert conversation_titles(chat_page) == ["How do I sort a list?", "Capital of France?"]
    assert chat_page.inner_text(".msg.user .content") == "How do I sort a list?"  # the open one came back
    assert chat_page.inner_text(".msg.assistant code") == "sorted()"

    chat_page.fill("#search", "paris")  # search looks into the messages too
    assert conversation_titles(chat_page) == ["Capital of France?"]
    chat_page.fill("#search", "")
    chat_page.click("#conversations li:nth-child(2) .open")
    assert chat_page.inner_text(".msg.assistant .content") == "Paris is the capital."
    chat_page.click("#conversations li:nth-child(2) .rename")  # the open one
    chat_page.fill(".rename-input", "Geography")
    chat_page.press(".rename-input", "Enter")
    assert conversation_titles(chat_page) == ["How do I sort a list?", "Geography"]

    with chat_page.expect_download() as download:
        chat_page.click("#export-json")
    exported = tmp_path / "chat.json"
    download.value.save_as(exported)
    data = json.loads(exported.read_text())
    assert data["title"] == "Geography"
    assert [(m["role"], m["content"]) for m in data["messages"]] == [
        ("user", "Capital of France?"),
        ("assistant", "Paris is the capital."),
    ]
    with chat_page.expect_download() as download:
        chat_page.click("#export-md")
    download.value.save_as(tmp_path / "chat.md")
    assert "## Assistant\n\nParis is the capital." in (tmp_path / "chat.md").read_text()

    chat_page.click("#conversations li:nth-child(2) .delete")  # asks first
    assert len(conversation_titles(chat_page)) == 2
    chat_page.click("#conversations li:nth-child(2) .delete")
    assert conversation_titles(chat_page) == ["How do I sort a list?"]
    assert chat_page.locator(".msg").count() == 0  # the open chat was the deleted one

    chat_page.set_input_files("#import-file", str(exported))
    chat_page.wait_for_function("() => document.querySelectorAll('#conversations li').length === 2")
    assert conversation_titles(chat_page)[0] == "Geography"
    assert chat_page.inner_text(".msg.assistant .content") == "Paris is the capital."
    imported = next(c for c in stored(chat_page) if c["title"] == "Geography")
    assert imported["messages"] == data["messages"]
    chat_page.reload()
    chat_page.wait_for_selector("#conversations li")
    assert sorted(conversation_titles(chat_page)) == ["Geography", "How do I sort a list?"]


def test_import_rejects_a_bad_file_and_renders_tool_calls_and_reasoning(chat_page, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"messages": [{"role": "user", "content": {"html": "<b>"}}]}')
    chat_page.set_input_files("#import-file", str(bad))
    chat_page.wait_for_selector("#error:not([hidden])")
    assert "Could not import bad.json" in chat_page.inner_text("#error")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"title": "<b>Tools</b>", "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning": "The user wants **weather**.", "tool_calls": [call]},
    ]}))  # fmt: skip
    chat_page.set_input_files("#import-file", str(good))
    chat_page.wait_for_selector(".tool-call")
    assert conversation_titles(chat_page) == ["<b>Tools</b>"]  # a title is text
    assert chat_page.inner_text(".tool-call summary") == "Tool call: get_weather"
    assert json.loads(chat_page.inner_text(".tool-call code")) == {"city": "Paris"}
    assert not chat_page.locator(".reasoning").evaluate("d => d.open")  # collapsed until asked
    chat_page.click(".reasoning summary")
    assert chat_page.inner_text(".reasoning strong") == "weather"


def test_regenerate_and_edit_resend_with_cached_prompt_tokens(chat_page, fake_engine, fake_runner):
    fake_runner.replies.extend([
        Reply.text("First answer."),
        Reply.text("Second answer."),
        Reply.text("Answer to the edit."),
    ])  # fmt: skip
    send_and_wait(chat_page, "Question one")
    chat_page.click(".msg.assistant button[data-action=regenerate]")
    chat_page.wait_for_function(f"() => {META}.includes('prompt tokens cached')")
    assert chat_page.locator(".msg").count() == 2
    assert chat_page.inner_text(".msg.assistant .content") == "Second answer."
    first, again = fake_runner.requests[0], fake_runner.requests[1]
    assert again.prompt_ids == first.prompt_ids  # the same question again: all of it cached but its last token
    assert f"{again.prompt_len - 1} of {again.prompt_len} prompt tokens cached" in chat_page.inner_text(".msg.assistant .meta")
    edited = [BOS, *fake_engine.tokenizer.encode(fake_engine.chat_template.render([{"role": "user", "content": "Question two"}]))]
    shared = len(os.path.commonprefix([first.prompt_ids, edited]))  # what the edit's prompt finds cached

    chat_page.click(".msg.user button[data-action=edit]")
    chat_page.fill(".editor textarea", "Question two")
    chat_page.press(".editor textarea", "Enter")
    chat_page.wait_for_function(f"() => {META}.includes('{shared} of')")
    assert chat_page.locator(".msg").count() == 2
    assert chat_page.inner_text(".msg.user .content") == "Question two"
    assert chat_page.inner_text(".msg.assistant .content") == "Answer to the edit."
    assert fake_engine.chat_template.calls[-1]["messages"] == [{"role": "user", "content": "Question two"}]
    chat_page.reload()
    chat_page.wait_for_selector(".msg.assistant")
    assert chat_page.inner_text(".msg.assistant .content") == "Answer to the edit."
    assert f"{shared} of" in chat_page.inner_text(".msg.assistant .meta")  # the figures are saved too


@pytest.mark.parametrize("fake_engine", [{"queue_limit": 0}], indirect=True)  # no request may wait
def test_a_busy_server_is_retried_after_retry_after(chat_page, fake_engine, pages):
    pages.expected += ["status of 429"]
    send_message(chat_page, "Hello?")
    chat_page.wait_for_function("() => document.getElementById('notice').textContent.includes('busy')")
    assert "Trying again in 1 s" in chat_page.inner_text("#notice")
    fake_engine.queue_limit = 1  # a place in the queue at last
    chat_page.wait_for_function(REPLY_DONE, timeout=15_000)
    assert chat_page.inner_text(".msg.assistant .content") == "Hello from the fake engine."
    assert not chat_page.is_visible("#notice") and not chat_page.is_visible("#error")


def test_json_reply_format_and_json_replies(chat_page, fake_runner):
    fake_runner.replies.append(Reply.text('{"city": "Paris", "days": [1, 2]}'))
    send_and_wait(chat_page, "Plan a trip")
    assert json.loads(chat_page.inner_text(".msg.assistant .code code")) == {"city": "Paris", "days": [1, 2]}
    assert chat_page.inner_text(".msg.assistant .code-head span") == "json"

    chat_page.click("#settings summary")
    chat_page.select_option("#reply-format", "json_schema")
    chat_page.fill("#json-schema", "{not json")
    send_message(chat_page, "Again")
    assert "not valid JSON" in chat_page.inner_text("#error")  # nothing was sent
    chat_page.fill("#json-schema", '{"type": "object"}')
    fake_runner.replies.append(Reply.text('Sure: {"ok": true}'))  # the server constrains the reply to the schema
    before = len(fake_runner.requests)
    with chat_page.expect_request("**/v1/chat/completions") as request:
        send_message(chat_page, "Again")
    sent = request.value.post_data_json["response_format"]
    assert sent == {"type": "json_schema", "json_schema": {"name": "reply", "schema": {"type": "object"}, "strict": True}}
    assert wait_until(lambda: len(fake_runner.requests) > before)
    chat_page.wait_for_function(REPLY_DONE)
    assert isinstance(json.loads(chat_page.locator(".msg.assistant .code code").last.inner_text()), dict)  # not the script's text
    assert chat_page.is_hidden("#error")


def test_keyboard_use(chat_page, fake_runner):
    fake_runner.replies.append(Reply.text("tick ", eos=False, delay=0.05, forever=True))
    chat_page.focus("#input")
    chat_page.keyboard.type("line one")
    chat_page.keyboard.press("Shift+Enter")
    chat_page.keyboard.type("line two")
    assert chat_page.input_value("#input") == "line one\nline two"
    chat_page.keyboard.press("Enter")
    chat_page.wait_for_function("() => document.querySelector('.msg.assistant.pending .content').textContent.includes('tick')")
    chat_page.keyboard.press("Escape")
    chat_page.wait_for_function(f"() => {META}.startsWith('stopped')")
    assert chat_page.inner_text(".msg.user .content") == "line one\nline two"
    chat_page.keyboard.press("Shift+Tab")  # from the composer back through the page: focus is visible
    outline = chat_page.evaluate("() => getComputedStyle(document.activeElement).outlineStyle")
    assert outline != "none"


def test_chat_page_has_no_serious_accessibility_violations(chat_page, fake_runner):
    fake_runner.replies.append(Reply.text(MARKDOWN))
    send_and_wait(chat_page, "How do I cook rice?")
    assert chat_page.is_hidden("#model-choice") and chat_page.title() == "fake-model · Chat"  # one model: its name
    assert axe_violations(chat_page) == []
    chat_page.emulate_media(color_scheme="dark")
    assert axe_violations(chat_page) == []
    chat_page.set_viewport_size(PHONE)
    chat_page.click("#open-sidebar")
    assert axe_violations(chat_page) == []

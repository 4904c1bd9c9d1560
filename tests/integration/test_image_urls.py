"""Image URLs fetched where the operator allows it (LLM_IMAGE_FETCH): a real server with a tiny model
and projector, told to fetch from 127.0.0.1 only, and a local HTTP server holding the pictures. An
image fetched answers as the same bytes sent inline do, through the `openai` client's chat and
Responses calls and the `anthropic` client's url source; a host not listed, a redirect to one, a
404, too many bytes and too slow a server are each a 400 naming the part, and the server goes on.
With `*`, no loopback, private or link-local address is fetched."""

from __future__ import annotations

import base64
import http.server
import threading
import time

import anthropic
import openai
import pytest
from support import assert_error_shape, post, tiny_engine_server
from support.tiny_models import write_tiny_gguf
from support.tiny_projectors import write_tiny_projector

from tests.integration.test_images_api import png
from webapp.openai.errors import ApiError
from webapp.openai.image_fetch import ImageFetcher

PICTURE = png(31)
MOST_BYTES = 64 * 1024


class Pictures(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        port = self.server.server_address[1]
        if self.path == "/cat.png":
            self._send(200, PICTURE)
        elif self.path == "/big.png":
            self._send(200, b"\x89PNG" + b"\0" * (2 * MOST_BYTES))
        elif self.path == "/slow.png":
            time.sleep(2.5)
            self._send(200, PICTURE)
        elif self.path == "/here":
            self._redirect(f"http://127.0.0.1:{port}/cat.png")
        elif self.path == "/away":
            self._redirect(f"http://localhost:{port}/cat.png")  # the same server, by a host name not listed
        else:
            self._send(404, b"no")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, to: str) -> None:
        self.send_response(302)
        self.send_header("Location", to)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def pictures():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Pictures)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("image-urls")
    model = write_tiny_gguf(str(folder / "tiny.gguf"), matrix_type="Q8_0")
    projector = write_tiny_projector(str(folder / "tiny.mmproj.gguf"), "idefics3", text_dim=64)
    config = {"IMAGE_FETCH": "127.0.0.1", "IMAGE_FETCH_BYTES": MOST_BYTES, "IMAGE_FETCH_SECONDS": 1}
    with tiny_engine_server(model, slots=2, queue_limit=8, context=256, mmproj=projector, config=config) as (_, server):
        yield server


def chat(server, url: str):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    content = [{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": url}}]
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": content}], max_tokens=1, temperature=0, logprobs=True
    )


def test_a_fetched_image_answers_as_the_same_bytes_inline_do(served, pictures):
    inline = chat(served, f"data:image/png;base64,{base64.b64encode(PICTURE).decode()}").choices[0].logprobs.content[0].logprob
    assert chat(served, f"{pictures}/cat.png").choices[0].logprobs.content[0].logprob == inline
    assert chat(served, f"{pictures}/here").choices[0].logprobs.content[0].logprob == inline  # a redirect to a listed host
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=60)
    reply = client.responses.create(
        model="tiny",
        max_output_tokens=2,
        input=[
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "Describe it."}, {"type": "input_image", "image_url": f"{pictures}/cat.png"}],
            }
        ],
    )
    assert reply.status in ("completed", "incomplete") and reply.usage.input_tokens > 16
    claude = anthropic.Anthropic(base_url=served.url, api_key="k", max_retries=0, timeout=60)
    image = {"type": "image", "source": {"type": "url", "url": f"{pictures}/cat.png"}}
    message = claude.messages.create(
        model="tiny", max_tokens=2, messages=[{"role": "user", "content": [image, {"type": "text", "text": "Hi"}]}]
    )
    assert message.usage.input_tokens > 16


@pytest.mark.parametrize(
    "path, says",
    [
        ("http://localhost:{port}/cat.png", "is not one this server fetches images from"),
        ("/away", "is not one this server fetches images from"),
        ("/missing.png", "answered 404"),
        ("/big.png", "at most 65536 are fetched"),
        ("/slow.png", "could not be fetched"),
        ("ftp://127.0.0.1/cat.png", "an http(s) URL is expected"),
    ],
)
def test_what_the_fetch_refuses_is_a_400_naming_the_part(served, pictures, path, says):
    port = pictures.rsplit(":", 1)[1]
    url = path.format(port=port) if "://" in path else pictures + path
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}
    started = time.monotonic()
    status, _, error = post(served, "/v1/chat/completions", body)
    assert status == 400 and says in error["error"]["message"], error
    assert error["error"]["param"] == "messages[0].content" and time.monotonic() - started < 5
    assert_error_shape(error)
    assert chat(served, f"{pictures}/cat.png").choices  # and the server goes on


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "10.1.2.3", "192.168.0.1", "169.254.169.254", "[::1]"])
def test_any_host_means_any_public_address_only(host):
    fetcher = ImageFetcher.from_setting("*", MOST_BYTES, 1)
    with pytest.raises(ApiError) as refused:
        fetcher(f"http://{host}/cat.png", "messages[0].content[0]", "messages[0].content")
    assert refused.value.status == 400 and "not public" in str(refused.value)
    assert ImageFetcher.from_setting("", MOST_BYTES, 1) is None and ImageFetcher.from_setting(None, MOST_BYTES, 1) is None


def test_any_host_checks_the_address_connected_to_as_well(pictures):
    """A name that resolved to a public address when checked and to another when connecting (DNS
    rebinding) is refused on the connection: here the first check is skipped outright."""
    fetcher = ImageFetcher.from_setting("*", MOST_BYTES, 1)
    fetcher.check = lambda url: None
    with pytest.raises(ApiError, match="not public"):
        fetcher(f"{pictures}/cat.png", "messages[0].content[0]", "messages[0].content")
    allowed = ImageFetcher.from_setting("127.0.0.1", MOST_BYTES, 1)  # a listed host is the operator's choice
    assert allowed(f"{pictures}/cat.png", "messages[0].content[0]", "messages[0].content") == PICTURE

"""Images in a chat body, whichever API sent them: where each one stands in its message, and its bytes.

Contract: every API's translator turns an image into an OpenAI `image_url` part holding a `data:` URL
(Anthropic's base64 `image` block and the Responses API's `input_image` become one); `part_text(part,
where)` is such a part's place in its message's text, `IMAGE_MARKER`, which the rendered prompt
keeps where the image's rows will go; `chat_images(messages)` is the images' bytes in the order their
markers appear, at most MAX_IMAGES of them. An `http(s)` URL is fetched by `fetch` (image_fetch.py's
`ImageFetcher`, where the operator allows fetching) and refused without one. What is wrong is an
`ApiError` 400 naming the part. No Flask, no engine.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable
from typing import Any

from webapp.openai.errors import ApiError

IMAGE_MARKER = "<__image__>"
MAX_IMAGES = 8  # a request's; each is hundreds of prompt positions and an encode
_DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?:;[\w-]+=[\w.-]+)*;base64,(?P<data>.*)", re.DOTALL)


def is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"


def part_text(part: dict, where: str, param: str) -> str:
    """An image part's place in its message's text; ApiError (of `param`) for a part without a usable URL."""
    _url(part, where, param)
    return IMAGE_MARKER


def chat_images(messages: list, fetch: Callable[[str, str, str], bytes] | None = None) -> tuple[bytes, ...]:
    """The images of a parsed chat body's raw messages, in order: decoded, or fetched by `fetch`."""
    found = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            if is_image(part):
                where, param = f"messages[{i}].content[{j}]", f"messages[{i}].content"
                found.append((_url(part, where, param), where, param))
    if len(found) > MAX_IMAGES:
        raise ApiError(400, f"A request may hold at most {MAX_IMAGES} images; this one holds {len(found)}.", "messages")
    return tuple(
        _bytes(url, where, param) if url.startswith("data:") else _fetched(url, where, param, fetch) for url, where, param in found
    )


def data_url(media_type: str, data: str) -> dict:
    """An OpenAI image part for base64 `data` (what Anthropic's and Ollama's images become)."""
    return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}}


def _url(part: dict, where: str, param: str) -> str:
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str) or not url:
        raise ApiError(400, f"'{where}.image_url' must hold a url.", param)
    if not url.startswith(("data:", "http://", "https://")):
        raise ApiError(400, f"'{where}': a data: URL (base64 image bytes) or an http(s) URL is expected.", param)
    return url


def _fetched(url: str, where: str, param: str, fetch) -> bytes:
    if fetch is None:
        raise ApiError(400, f"'{where}': only data: URLs are taken (base64 image bytes); this server fetches no URL.", param)
    return fetch(url, where, param)


def _bytes(url: str, where: str, param: str) -> bytes:
    found = _DATA_URL.fullmatch(url)
    if found is None:
        raise ApiError(400, f"'{where}': a data URL of the form data:image/png;base64,... is expected.", param)
    try:
        return base64.b64decode("".join(found["data"].split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ApiError(400, f"'{where}': the data URL's base64 does not decode ({e}).", param) from e

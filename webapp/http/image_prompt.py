"""A rendered chat prompt with images in it, as token ids and the images' spans.

Contract: `image_prompt(engine, prompt, images)` splits `prompt` at its image markers
(webapp/openai/images.py), prepares each image for the served model's projector (`engine.vision`),
and returns the prompt's token ids, each image standing as its pieces (a family's tiles and
overview, or the whole image), each its family's text around a run of placeholder ids, with the
`ImageSpan`s the engine feeds the pieces' rows at. A model without a
projector, a marker the chat template dropped or an image that does not decode is an `ApiError` 400.
"""

from __future__ import annotations

from webapp.engine.vision.images import ImageError
from webapp.engine.vision.vision import ImageSpan
from webapp.openai.errors import ApiError
from webapp.openai.images import IMAGE_MARKER


def image_prompt(engine, prompt: str, images: tuple[bytes, ...]) -> tuple[list[int], tuple[ImageSpan, ...]]:
    vision, tokenizer = engine.vision, engine.tokenizer
    if vision is None:
        why = "it was loaded without a projector file (LLM_MMPROJ, or NAME.mmproj.gguf beside it)"
        raise ApiError(400, f"The model {engine.model_name} takes no images: {why}.", "messages", "images_not_supported")
    pieces = prompt.split(IMAGE_MARKER)
    if len(pieces) != len(images) + 1:
        raise ApiError(
            400, f"The chat template kept {len(pieces) - 1} of the {len(images)} images; send them in user messages.", "messages"
        )
    ids = tokenizer.encode(pieces[0], special=True)
    if tokenizer.add_bos and tokenizer.bos_id is not None and ids[:1] != [tokenizer.bos_id]:
        ids = [tokenizer.bos_id, *ids]
    spans = []
    for number, (data, text) in enumerate(zip(images, pieces[1:], strict=True), 1):
        try:
            pieces = vision.prepare(data)
        except ImageError as e:
            raise ApiError(400, f"Image {number} of the request: {e}.", "messages", "invalid_image") from e
        for piece in pieces:
            ids += tokenizer.encode(piece.before, special=True)
            spans.append(ImageSpan(len(ids), piece))
            ids += [vision.placeholder(piece)] * piece.tokens
            ids += tokenizer.encode(piece.after, special=True)
        ids += tokenizer.encode(text, special=True)
    return ids, tuple(spans)

"""An image from a request's bytes, decoded under hard limits: untrusted input, refused in one line.

Contract: `decode_image(data)` returns the picture as RGB uint8 (height, width, 3), or raises
`ImageError` naming what is wrong: no bytes, more than MAX_IMAGE_BYTES, not one of the formats in
`FORMATS`, more than MAX_IMAGE_PIXELS (read from the header, before any pixel is decoded: a
decompression bomb is refused unopened), or truncated or corrupt data. Pillow decodes; nothing else
here reads the bytes.
"""

from __future__ import annotations

import io
import warnings

import numpy as np

MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_IMAGE_PIXELS = 40_000_000  # an 8K photo; a header that claims more is refused unread
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


class ImageError(ValueError):
    """What is wrong with an image a request sent; the API answers it with a 400."""


def decode_image(data: bytes) -> np.ndarray:
    from PIL import Image  # the web layer's callers only: loading the engine needs no Pillow

    if not data:
        raise ImageError("the image is empty")
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(f"the image is {len(data)} bytes; at most {MAX_IMAGE_BYTES} are taken")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            picture = Image.open(io.BytesIO(data), formats=FORMATS)
            width, height = picture.size
            if width < 1 or height < 1 or width * height > MAX_IMAGE_PIXELS:
                raise ImageError(f"the image is {width}x{height} pixels; at most {MAX_IMAGE_PIXELS} pixels are taken")
            picture.load()
            return np.asarray(picture.convert("RGB"), dtype=np.uint8)
    except ImageError:
        raise
    except Image.UnidentifiedImageError as e:
        raise ImageError(f"the data is not an image in one of the formats {', '.join(FORMATS)}") from e
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageError("the image decompresses to too many pixels") from e
    except (OSError, SyntaxError, ValueError, EOFError, MemoryError) as e:
        raise ImageError(f"the image is truncated or corrupt ({type(e).__name__})") from e

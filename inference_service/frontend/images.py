"""Images a request names: `data:` URIs, http(s) URLs and raw bytes, read and decoded here.

Runs on the front end's worker thread (never the event loop, never the engine thread). Every
failure is the caller's input, a `ValidationError` naming the problem: an unreachable or oversized
URL, bytes that are not a PNG, JPEG, WebP or GIF image (a GIF gives its first frame). A URL is
fetched with a timeout and read at most `max_fetch_size` bytes (TGI's `--max-image-fetch-size`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from inference_service.errors import ValidationError, shortened

FETCH_TIMEOUT_S = 10.0
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
MAX_PIXELS = 64 * 1024 * 1024  # a decompression bomb is refused before it is decoded
# TGI's `inputs` carry images as Markdown: ![alt](url).
MARKDOWN_IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


@dataclass(frozen=True)
class LoadedImage:
    """A decoded RGB image and the hash of the bytes it came from."""

    image: Any  # PIL.Image.Image
    content_hash: bytes


def load_url(url: str, max_fetch_size: int) -> LoadedImage:
    """The image a `data:` URI holds or an http(s) URL serves."""
    if url.startswith("data:"):
        return decode(_data_uri_bytes(url, max_fetch_size), max_fetch_size, "the data: URI")
    scheme = urllib.parse.urlsplit(url).scheme
    if scheme not in ("http", "https"):
        raise ValidationError(f"image URL {shortened(url, 80)!r} must be an http(s) URL or a data: URI")
    return decode(_fetch(url, max_fetch_size), max_fetch_size, f"image URL {shortened(url, 80)!r}")


def decode(data: bytes, max_size: int, source: str = "the image") -> LoadedImage:
    """Bytes → an RGB image; anything that is not a whole image of a known format is refused."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > max_size:
        raise ValidationError(f"{source} is {len(data)} bytes, more than the {max_size} allowed")
    try:
        with Image.open(io.BytesIO(data)) as opened:
            if opened.format not in FORMATS:
                raise ValidationError(f"{source} is a {opened.format} image: send PNG, JPEG, WebP or GIF")
            if opened.width * opened.height > MAX_PIXELS:
                raise ValidationError(f"{source} is {opened.width}x{opened.height} pixels, too large")
            opened.seek(0)  # a GIF's first frame
            image = opened.convert("RGB")
    except ValidationError:
        raise
    except UnidentifiedImageError:
        raise ValidationError(f"{source} is not an image (PNG, JPEG, WebP or GIF)") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as error:  # a truncated or broken file
        raise ValidationError(
            f"{source} is not an image (PNG, JPEG, WebP or GIF): {shortened(str(error), 120)}"
        ) from None
    return LoadedImage(image, hashlib.sha256(data).digest())


def _data_uri_bytes(url: str, max_size: int) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise ValidationError("an image data: URI must be base64: data:image/png;base64,...")
    if len(payload) * 3 // 4 > max_size + 3:
        raise ValidationError(f"the data: URI's image is more than the {max_size} bytes allowed")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise ValidationError(f"the data: URI is not valid base64: {error}") from None


def _fetch(url: str, max_size: int) -> bytes:
    request = urllib.request.Request(url, headers={"User-Agent": "inference-service"})
    try:
        with urllib.request.urlopen(request, timeout=FETCH_TIMEOUT_S) as response:
            length = response.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > max_size:
                raise ValidationError(
                    f"image URL {shortened(url, 80)!r} serves {length} bytes, more than the {max_size} allowed"
                )
            data = response.read(max_size + 1)
    except ValidationError:
        raise
    except urllib.error.HTTPError as error:
        raise ValidationError(f"image URL {shortened(url, 80)!r} could not be fetched: HTTP {error.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as error:
        reason = getattr(error, "reason", error)
        raise ValidationError(f"image URL {shortened(url, 80)!r} could not be fetched: {reason}") from None
    if len(data) > max_size:
        raise ValidationError(f"image URL {shortened(url, 80)!r} serves more than the {max_size} bytes allowed")
    return data


def markdown_image_urls(text: str) -> list[str]:
    """The URLs of TGI's Markdown images `![](url)` in a prompt, in order."""
    return MARKDOWN_IMAGE.findall(text)

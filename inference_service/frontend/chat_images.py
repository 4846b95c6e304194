"""Images in a conversation: OpenAI's `image_url` content parts, and the typed API's raw bytes.

Each message's images are collected in conversation order and their parts rewritten into the
shape vision chat templates read (`{"type": "image"}`, as transformers' processors write them). A
typed `ChatMessage` carries its images' bytes in `images`: each `{"type": "image"}` part takes the
next one, and those no part names come before the message's text (where most templates put them).
"""

from __future__ import annotations

from typing import Any

from inference_service.errors import ValidationError, quoted

ImageSource = str | bytes  # a URL (data: or http(s)) or the image's bytes


def collect_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[ImageSource]]:
    """The messages with image parts as `{"type": "image"}`, and the images in order."""
    sources: list[ImageSource] = []
    rewritten = []
    for message in messages:
        raw = list(message.get("images") or ())
        rest = {key: value for key, value in message.items() if key != "images"}
        content = message.get("content")
        if not raw and not (isinstance(content, list) and any(_is_image(part) for part in content)):
            rewritten.append(rest)
            continue
        parts = content if isinstance(content, list) else ([{"type": "text", "text": content}] if content else [])
        new_parts, named = _rewritten_parts(parts, raw)
        leftover = raw[len([s for s in named if not isinstance(s, str)]) :]
        sources += [*leftover, *named]
        rewritten.append({**rest, "content": [{"type": "image"} for _ in leftover] + new_parts})
    return rewritten, sources


def _rewritten_parts(parts: list[Any], raw: list[bytes]) -> tuple[list[dict[str, Any]], list[ImageSource]]:
    """The parts in the templates' shape, and the images they name in order (`image` parts take
    the message's bytes in order)."""
    new_parts: list[dict[str, Any]] = []
    named: list[ImageSource] = []
    num_raw_used = 0
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image_url":
            image_url = part.get("image_url")
            url = image_url.get("url") if isinstance(image_url, dict) else None
            if not isinstance(url, str) or not url:
                raise ValidationError("an `image_url` content part needs `image_url.url`")
            named.append(url)
            new_parts.append({"type": "image"})
        elif kind == "image":
            if num_raw_used >= len(raw):
                raise ValidationError("an `image` content part names no image: add its bytes to the message's `images`")
            named.append(raw[num_raw_used])
            num_raw_used += 1
            new_parts.append({"type": "image"})
        elif kind == "text":
            new_parts.append({"type": "text", "text": str(part.get("text", ""))})
        else:
            raise ValidationError(f"unsupported content part type {quoted(kind)}: use 'text' or 'image_url'")
    return new_parts, named


def has_images(messages: list[dict[str, Any]]) -> bool:
    for message in messages:
        if message.get("images"):
            return True
        content = message.get("content")
        if isinstance(content, list) and any(_is_image(part) for part in content):
            return True
    return False


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image_url", "image")

"""Images a request names, read in the front end: formats, URLs, limits and every bad input."""

from __future__ import annotations

import hashlib
import io
import socket

import pytest

from inference_service.errors import ValidationError
from inference_service.frontend import images
from inference_service.frontend.chat_images import collect_images, has_images
from inference_service.frontend.vision import check_image_count
from inference_service.outputs import EngineInfo
from tests.image_server import data_uri, image_bytes, serving

MAX = 1 << 20


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_data_uris_of_each_format_decode_to_rgb(fmt):
    data = image_bytes((10, 200, 10), (20, 12), fmt)
    loaded = images.load_url(data_uri(data, fmt), MAX)
    assert loaded.image.mode == "RGB" and loaded.image.size == (20, 12)
    assert loaded.content_hash == hashlib.sha256(data).digest()
    red, green, _ = loaded.image.getpixel((5, 5))
    assert green > 150 and red < 60


def test_a_gif_gives_its_first_frame():
    from PIL import Image

    frames = [Image.new("RGB", (8, 8), color) for color in ((255, 0, 0), (0, 0, 255))]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:])
    loaded = images.decode(buffer.getvalue(), MAX)
    assert loaded.image.getpixel((1, 1))[0] > 200


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("data:image/png;base64,aGVsbG8gd29ybGQ=", "is not an image"),
        ("data:image/png,rawtext", "must be base64"),
        ("data:image/png;base64,@@@", "not valid base64"),
        ("ftp://example.com/cat.png", "http(s) URL or a data: URI"),
        ("cat.png", "http(s) URL or a data: URI"),
    ],
)
def test_bad_urls_are_validation_errors_naming_the_problem(url, message):
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        images.load_url(url, MAX)


def test_an_image_over_the_size_limit_is_refused():
    data = image_bytes(size=(64, 64))
    with pytest.raises(ValidationError, match="allowed"):
        images.load_url(data_uri(data), len(data) - 10)
    with pytest.raises(ValidationError, match="allowed"):
        images.decode(data, len(data) - 1)


def test_a_bmp_is_not_one_of_the_formats():
    with pytest.raises(ValidationError, match="BMP"):
        images.decode(image_bytes(fmt="BMP"), MAX)


def test_urls_are_fetched_and_bounded():
    png = image_bytes((1, 2, 3))
    big = image_bytes(size=(300, 300))
    with serving({"/cat.png": png, "/big.png": big, "/text": b"not an image"}) as base:
        assert images.load_url(f"{base}/cat.png", MAX).content_hash == hashlib.sha256(png).digest()
        with pytest.raises(ValidationError, match="HTTP 404"):
            images.load_url(f"{base}/missing.png", MAX)
        with pytest.raises(ValidationError, match="more than the 100 allowed"):
            images.load_url(f"{base}/big.png", 100)
        with pytest.raises(ValidationError, match="is not an image"):
            images.load_url(f"{base}/text", MAX)


def test_an_unreachable_url_is_a_validation_error():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(ValidationError, match="could not be fetched"):
        images.load_url(f"http://127.0.0.1:{port}/cat.png", MAX)


def test_markdown_images_in_tgi_inputs():
    text = "look ![](http://a/b.png) and ![a cat](data:image/png;base64,AAA=) then [link](x)"
    assert images.markdown_image_urls(text) == ["http://a/b.png", "data:image/png;base64,AAA="]


def test_chat_images_are_collected_in_conversation_order():
    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "compare"},
                {"type": "image_url", "image_url": {"url": "u1"}},
                {"type": "image"},
            ],
            "images": [b"raw-a", b"raw-b"],
        },
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u2"}}]},
    ]
    assert has_images(messages) and not has_images(messages[:1])
    rewritten, sources = collect_images(messages)
    # raw-b is named by no part: it comes first; raw-a fills the `image` part.
    assert sources == [b"raw-b", "u1", b"raw-a", "u2"]
    assert rewritten[0] == messages[0]
    assert rewritten[1]["content"] == [
        {"type": "image"},
        {"type": "text", "text": "compare"},
        {"type": "image"},
        {"type": "image"},
    ]
    assert "images" not in rewritten[1]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ([{"type": "image_url", "image_url": {}}], "needs `image_url.url`"),
        ([{"type": "image"}], "names no image"),
        ([{"type": "image_url", "image_url": {"url": "u"}}, {"type": "audio"}], "'audio'"),
    ],
)
def test_bad_content_parts(content, message):
    with pytest.raises(ValidationError, match=message):
        collect_images([{"role": "user", "content": content}])


def _info(**fields) -> EngineInfo:
    base = dict(
        model_id="m",
        model_sha=None,
        architecture="llama",
        dtype="float32",
        device="cpu",
        vocab_size=10,
        eos_token_ids=(1,),
        block_size=4,
        num_blocks=4,
        max_input_tokens=10,
        max_total_tokens=20,
        max_batch_prefill_tokens=10,
        max_batch_size=None,
        max_concurrent_requests=1,
        max_best_of=1,
        max_stop_sequences=1,
        max_top_n_tokens=1,
        max_images_per_request=2,
    )
    return EngineInfo(**{**base, **fields})


def test_image_counts_and_text_only_models():
    with pytest.raises(ValidationError, match=r"\(llama\) is text-only"):
        check_image_count(_info(), 1)
    check_image_count(_info(), 0)
    check_image_count(_info(vision_architecture="llava"), 2)
    with pytest.raises(ValidationError, match="at most 2 images per request"):
        check_image_count(_info(vision_architecture="llava"), 3)

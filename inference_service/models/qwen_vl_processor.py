"""Qwen2-VL and Qwen2.5-VL's processor, images only: transformers' own `Qwen2VLProcessor` (its
placeholder expansion, token types and grids) over the family's PIL image processor.

`AutoProcessor` would also build the video processor, which needs torchvision; this engine takes
no videos, so the processor is built without one and runs on torch's CPU wheel alone.
"""

from __future__ import annotations

import os
from typing import Any

QWEN_VL_FAMILIES = ("qwen2_vl", "qwen2_5_vl")


def load_qwen_vl_processor(folder: str | os.PathLike, trust_remote_code: bool = False) -> Any:
    from transformers import AutoImageProcessor, AutoTokenizer

    folder = os.fspath(folder)
    options = {"trust_remote_code": trust_remote_code, "local_files_only": True}
    image_processor = AutoImageProcessor.from_pretrained(folder, backend="pil", **options)
    tokenizer = AutoTokenizer.from_pretrained(folder, **options)
    return image_only_processor_class()(image_processor=image_processor, tokenizer=tokenizer)


def image_only_processor_class() -> type:
    """`Qwen2VLProcessor` without its video processor (Qwen2.5-VL's processor is the same class
    with a video-only difference); imported when a Qwen VL model is loaded."""
    from transformers import Qwen2VLProcessor

    class QwenVLImageProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            # The processor's attributes are read off this signature: no `video_processor`.
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return QwenVLImageProcessor

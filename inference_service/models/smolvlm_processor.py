"""SmolVLM's processor, images only: transformers' own `SmolVLMProcessor` (its tile tags, global
image and `image_seq_len` placeholders) over the family's PIL image processor.

`AutoProcessor` would also build SmolVLM's video processor, which needs torchvision; this engine
takes no videos, so the processor is built without one and runs on torch's CPU wheel alone. The
processor itself needs `num2words` (it spells video frame counts), a dependency of this package.
"""

from __future__ import annotations

import os
from typing import Any

SMOLVLM_FAMILIES = ("smolvlm",)


def load_smolvlm_processor(folder: str | os.PathLike, trust_remote_code: bool = False) -> Any:
    from transformers import AutoImageProcessor, AutoTokenizer

    folder = os.fspath(folder)
    options = {"trust_remote_code": trust_remote_code, "local_files_only": True}
    image_processor = AutoImageProcessor.from_pretrained(folder, backend="pil", **options)
    tokenizer = AutoTokenizer.from_pretrained(folder, **options)
    cls = image_only_processor_class()
    # processor_config.json's own settings (image_seq_len, chat template), minus the sub-processors.
    settings, extra = cls.get_processor_dict(folder, **options)
    return cls.from_args_and_dict([image_processor, tokenizer], settings, **extra)


def image_only_processor_class() -> type:
    """`SmolVLMProcessor` without its video processor; imported when a SmolVLM model is loaded."""
    from transformers import SmolVLMProcessor

    class SmolVLMImagesOnlyProcessor(SmolVLMProcessor):
        def __init__(
            self, image_processor=None, tokenizer=None, image_seq_len: int = 169, chat_template=None, **kwargs
        ):
            # The processor's attributes are read off this signature: no `video_processor`.
            super().__init__(
                image_processor, tokenizer, None, image_seq_len=image_seq_len, chat_template=chat_template, **kwargs
            )

    return SmolVLMImagesOnlyProcessor

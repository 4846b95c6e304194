"""A vision-language model's prompts: the model's own processor turns prompt text (one image
placeholder per image, as its chat template writes them) and the images into token ids and one
`ImageInput` per image (its pixel values, where its expanded placeholder tokens sit, its hash).

Runs on the front end's worker thread. A text-only model has no processor: any image it is sent is
refused here, naming the architecture.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

from inference_service.errors import ValidationError, shortened
from inference_service.frontend.images import MARKDOWN_IMAGE, LoadedImage
from inference_service.frontend.vision_family import VisionFamily
from inference_service.frontend.vision_gemma3 import Gemma3Family
from inference_service.frontend.vision_idefics3 import Idefics3Family
from inference_service.frontend.vision_mllama import MllamaFamily
from inference_service.frontend.vision_paligemma import PaliGemmaFamily
from inference_service.outputs import EngineInfo
from inference_service.sampling_params import ImageInput

# What one image is in a raw prompt (TGI's Markdown images are replaced by it), where the family's
# processor does not expand a bare image token.
RAW_PROMPT_IMAGE = {
    "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>",
}
# Families whose placeholders or attention differ from LLaVA's (each in its own module).
FAMILIES: dict[str, type[VisionFamily]] = {
    "gemma3": Gemma3Family,
    "paligemma": PaliGemmaFamily,
    "idefics3": Idefics3Family,
    "smolvlm": Idefics3Family,
    "mllama": MllamaFamily,
}
TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


def refuse_images(info: EngineInfo) -> NoReturn:
    """An image was sent to a model that cannot read it."""
    raise ValidationError(f"this model ({info.architecture}) is text-only: it does not take images")


def check_image_count(info: EngineInfo, num_images: int) -> None:
    if num_images and info.vision_architecture is None:
        refuse_images(info)
    limit = info.max_images_per_request
    if num_images > limit:
        raise ValidationError(f"at most {limit} images per request (--max-images-per-request). Given: {num_images}")


class VisionPrompts:
    """The processor of a loaded vision-language model, and where its image tokens go."""

    def __init__(self, processor: Any, info: EngineInfo):
        self.processor = processor
        self.info = info
        self.tokenizer = processor.tokenizer
        self.image_token: str = processor.image_token
        self.family = FAMILIES.get(info.vision_architecture or "", VisionFamily)(processor)
        self.image_token_id: int = self.family.placeholder_id()
        self.raw_prompt_image = RAW_PROMPT_IMAGE.get(info.vision_architecture or "", self.image_token)

    def with_placeholders(self, inputs: str) -> str:
        """TGI's `inputs`: each Markdown image `![](url)` becomes the model's image placeholder."""
        return MARKDOWN_IMAGE.sub(lambda _match: self.raw_prompt_image, inputs)

    def prepare(
        self, prompt: str, images: Sequence[LoadedImage], add_special_tokens: bool
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """The prompt's token ids (placeholders expanded) and its images, in order."""
        try:
            outputs = self.processor(
                text=[prompt],
                images=[image.image for image in images],
                return_tensors="pt",
                add_special_tokens=add_special_tokens,
            )
        except Exception as error:  # a placeholder count that does not match the images, a bad size
            raise ValidationError(f"the model's processor refused the images: {shortened(str(error), 200)}") from None
        token_ids = outputs["input_ids"][0].tolist()
        runs = self.family.image_runs(token_ids, self.image_token_id, len(images))
        if len(runs) != len(images):
            raise ValidationError(f"the prompt has {len(runs)} image placeholders for {len(images)} images")
        per_image = self.family.split(outputs, runs) or _split_per_image(outputs, len(images))
        spans = self.family.both_way_spans(outputs, runs)
        inputs = tuple(
            ImageInput(positions=run, content_hash=image.content_hash, pixel_values=pixels, extras=extras, span=span)
            for run, image, (pixels, extras), span in zip(runs, images, per_image, spans, strict=True)
        )
        return token_ids, inputs


def _split_per_image(outputs: Any, num_images: int) -> list[tuple[Any, dict[str, Any]]]:
    """The processor's batch of image tensors, cut into each image's own: Qwen2-VL packs patches
    of all images in one tensor (cut by `image_grid_thw`), the others stack one entry per image."""
    pixels = outputs["pixel_values"]
    grid = outputs.get("image_grid_thw")
    if grid is not None:
        sizes = grid.prod(dim=-1).tolist()
        chunks = list(pixels.split(sizes))
    else:
        chunks = [pixels[i : i + 1] for i in range(num_images)]
    extras_of: list[dict[str, Any]] = [{} for _ in range(num_images)]
    for key, value in outputs.items():
        if key in TEXT_KEYS or key == "pixel_values":
            continue
        if hasattr(value, "shape") and value.shape and value.shape[0] == num_images:
            for i in range(num_images):
                extras_of[i][key] = value[i : i + 1]
    return list(zip(chunks, extras_of, strict=True))

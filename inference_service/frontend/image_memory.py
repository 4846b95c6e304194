"""A request's images must fit the memory the server kept for its image encoder at startup (out of
the KV cache's budget): more crops than that are refused at validation, naming both sizes."""

from __future__ import annotations

from collections.abc import Sequence

from inference_service.errors import ValidationError
from inference_service.outputs import EngineInfo
from inference_service.sampling_params import ImageInput


def check_encoder_memory(info: EngineInfo, images: Sequence[ImageInput]) -> None:
    if not info.encoder_memory_bytes or not info.encoder_crop_values:
        return
    values = sum(image.pixel_values.numel() for image in images)
    crops = -(-values // info.encoder_crop_values)
    needed = crops * info.encoder_crop_bytes
    if needed > info.encoder_memory_bytes:
        raise ValidationError(
            f"the images need {needed / 2**20:.1f} MiB to encode ({crops} crops); this server keeps "
            f"{info.encoder_memory_bytes / 2**20:.1f} MiB for its image encoder: send fewer or smaller images"
        )

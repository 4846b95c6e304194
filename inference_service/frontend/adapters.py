"""Which LoRA adapter serves a request: TGI's `adapter_id`, or OpenAI's `model` naming one.

The base model's own name (or nothing) means the base model. Any other name must be a loaded
adapter; otherwise the request is refused as not found, naming what is loaded, before it reaches
the engine. OpenAI clients must send some `model`: while the server serves no adapters, any value
is accepted for the base (as TGI does); once it does, OpenAI's `model` must name the base, TGI's
placeholder "tgi", or an adapter.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from inference_service.errors import NotFoundError, quoted

# What OpenAI clients of TGI conventionally send as `model` for "the served model".
OPENAI_PLACEHOLDER_MODELS = ("tgi", "")


class AdapterNames:
    """The base model's name and a view of the loaded adapters' names (they change at run time)."""

    def __init__(self, base_name: str, loaded: Callable[[], Collection[str]] | None = None):
        self.base_name = base_name
        self._loaded = loaded  # None: the server serves no adapters

    @property
    def enabled(self) -> bool:
        return self._loaded is not None

    def loaded(self) -> list[str]:
        return sorted(self._loaded()) if self._loaded is not None else []

    def resolve(self, adapter_id: str | None) -> str | None:
        """TGI's `adapter_id` → the adapter's name, or None for the base model."""
        if adapter_id is None or adapter_id == "" or adapter_id == self.base_name:
            return None
        if adapter_id in self.loaded():
            return adapter_id
        raise NotFoundError(self._not_found(adapter_id))

    def from_openai_model(self, model: str) -> str | None:
        """OpenAI's `model` → the adapter's name, or None for the base model."""
        if not self.enabled or model in OPENAI_PLACEHOLDER_MODELS:
            return None
        return self.resolve(model)

    def _not_found(self, name: str) -> str:
        loaded = self.loaded()
        served = f"the base model {self.base_name!r}" + (
            f" and the LoRA adapters {', '.join(map(repr, loaded))}" if loaded else " (no LoRA adapters are loaded)"
        )
        return f"The model or LoRA adapter {quoted(name)} does not exist: this server serves {served}"

"""What every API surface calls: the engine and its front end once the model is loaded, and the
request observer (metrics, traces, logs of each call)."""

from __future__ import annotations

from inference_service.engine.async_engine import AsyncEngine
from inference_service.errors import UnavailableError
from inference_service.frontend.front_end import FrontEnd
from inference_service.observability.requests import RequestObserver


class Backend:
    """The serving model, attached once loaded; until then every call is UNAVAILABLE."""

    def __init__(self, observer: RequestObserver | None = None):
        self.observer = observer or RequestObserver()
        self._engine: AsyncEngine | None = None
        self._front_end: FrontEnd | None = None

    def attach(self, engine: AsyncEngine, front_end: FrontEnd) -> None:
        self._engine, self._front_end = engine, front_end

    def engine(self) -> AsyncEngine:
        if self._engine is None:
            raise UnavailableError("the model is still loading")
        return self._engine

    def front_end(self) -> FrontEnd:
        if self._front_end is None:
            raise UnavailableError("the model is still loading")
        return self._front_end

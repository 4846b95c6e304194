"""`GET /openapi.json` and `GET /docs`: the OpenAPI document generated from the proto (committed
beside the descriptor set, `protos/textgen/openapi.json`) and Swagger UI over it, from the
swagger-ui-bundle package's assets. Nothing is fetched from elsewhere: the page works offline."""

from __future__ import annotations

import functools
from importlib import resources

OPENAPI_CONTENT_TYPE = "application/json"
# The assets the page loads, and their types; anything else is not served.
ASSETS = {
    "swagger-ui-bundle.js": "application/javascript",
    "swagger-ui-standalone-preset.js": "application/javascript",
    "swagger-ui.css": "text/css",
    "favicon-32x32.png": "image/png",
    "favicon-16x16.png": "image/png",
}
# Relative links, so the page works behind a proxy's path prefix: at /docs, `docs/x` is /docs/x and
# `openapi.json` is /openapi.json. The same page answers /docs/, where a base of `../` (set before any
# link is read) makes the same links resolve as from /docs.
PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<script>
if (location.pathname.endsWith("/")) {
  document.head.appendChild(Object.assign(document.createElement("base"), {href: "../"}));
}
</script>
<title>inference-service REST API</title>
<link rel="stylesheet" href="docs/swagger-ui.css">
<link rel="icon" type="image/png" href="docs/favicon-32x32.png" sizes="32x32">
</head>
<body>
<div id="swagger-ui"></div>
<script src="docs/swagger-ui-bundle.js"></script>
<script src="docs/swagger-ui-standalone-preset.js"></script>
<script>
window.ui = SwaggerUIBundle({url: "openapi.json", dom_id: "#swagger-ui", deepLinking: true,
  presets: [SwaggerUIBundle.presets.apis, SwaggerUIStandalonePreset], layout: "StandaloneLayout"});
</script>
</body>
</html>
"""


@functools.cache
def openapi_document() -> bytes:
    return resources.files("textgen").joinpath("openapi.json").read_bytes()


def docs_file(name: str) -> tuple[str, bytes] | None:
    """(content type, bytes) of the page (`""`) or one of its assets; None for anything else."""
    if not name:
        return "text/html; charset=utf-8", PAGE.encode()
    return (ASSETS[name], _asset(name)) if name in ASSETS else None


@functools.cache
def _asset(name: str) -> bytes:
    """Read once (only the few names of ASSETS reach here): they never change while serving."""
    from swagger_ui_bundle import swagger_ui_path

    return (swagger_ui_path / name).read_bytes()

"""What a request's output must match (`GrammarSpec`), from the API's forms: TGI's `grammar`
parameter, JSON schemas, regexes and llguidance's Lark (`%json{...}` rules in the "json" kind's
whitespace style). Plain data, checked here; `grammar.GrammarCompiler` compiles it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from inference_service.errors import ValidationError, quoted

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of llguidance's stub only

KINDS = ("json", "regex", "lark")
# One whitespace style: flexible whitespace lets a weak model loop on blanks until max_new_tokens.
# The separators are the usual `json.dumps` ones, the spacing models most often write.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match. `kind`: "json" (`value` is a JSON schema as JSON text), "regex"
    (the whole output full-matches `value`) or "lark" (llguidance's Lark syntax, `%json{...}` allowed)."""

    kind: str
    value: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValidationError(
                f"grammar is not valid: unknown grammar kind {quoted(self.kind)}; expected one of {', '.join(KINDS)}"
            )
        if not isinstance(self.value, str):
            raise ValidationError(f"grammar is not valid: a {self.kind} grammar's value must be a string")


def grammar_spec_from_tgi(grammar: dict) -> GrammarSpec:
    """TGI's `parameters.grammar`: `{"type": "json" | "json_object", "value": schema or its JSON text}`,
    `{"type": "json_schema", "value": {"name"?: str, "schema": {...}}}` or `{"type": "regex", "value": str}`.

    Unlike TGI, any schema is accepted (no top-level `properties` needed): `{"type": "object"}` is JSON mode.
    """
    if not isinstance(grammar, dict):
        raise ValidationError("grammar is not valid: expected an object with `type` and `value`")
    kind, value = grammar.get("type"), grammar.get("value")
    if kind in ("json", "json_object"):
        return GrammarSpec("json", _schema_text(value))
    if kind == "json_schema":
        if not isinstance(value, dict) or "schema" not in value:
            raise ValidationError(
                'grammar is not valid: a json_schema grammar\'s value must be {"name"?: string, "schema": {...}}'
            )
        if not isinstance(value.get("name", ""), str):
            raise ValidationError("grammar is not valid: a json_schema grammar's `name` must be a string")
        return GrammarSpec("json", _schema_text(value["schema"]))
    if kind == "regex":
        if not isinstance(value, str):
            raise ValidationError("grammar is not valid: a regex grammar's value must be a string")
        return GrammarSpec("regex", value)
    raise ValidationError(
        f"grammar is not valid: unknown grammar type {quoted(kind)}; expected json, json_object, json_schema or regex"
    )


def lark_json(schema: Any) -> str:
    """A Lark rule body matching `schema`'s JSON, in the same whitespace style as the "json" kind."""
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}
    return f"%json {json.dumps(schema)}"


def _schema_text(value: Any) -> str:
    """A schema object, or a string holding one, as compact JSON text. Keys keep their order: the
    output's properties come in the schema's order."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise ValidationError(f"grammar is not valid: the schema is not JSON: {error}") from None  # no echo
    if not isinstance(value, (dict, bool)):
        raise ValidationError("grammar is not valid: a JSON schema must be an object")
    return json.dumps(value, separators=(",", ":"))

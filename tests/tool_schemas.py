"""Tool schemas the API tests share (one small enum argument: calls a tiny model can be forced to write)."""

TIME_ZONE_PARAMETERS = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}

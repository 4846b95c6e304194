"""The demo model (SmolLM2-Instruct, whose generation-config EOS differs from its tokenizer's) under a
JSON schema: the output is valid JSON that validates, ended by the grammar."""

from __future__ import annotations

import json

import jsonschema
import pytest

from inference_service.frontend.parameters import GenerateParameters, GenerateRequest
from tests.engine_calls import validated

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
PROMPT = "<|im_start|>user\nDescribe a person, Alice aged 31, as JSON.<|im_end|>\n<|im_start|>assistant\n"


def test_demo_model_writes_a_person_that_validates(demo_grpc_server):
    engine = demo_grpc_server.engine

    async def run():
        request = GenerateRequest(
            PROMPT,
            GenerateParameters(max_new_tokens=60, grammar={"type": "json", "value": json.dumps(PERSON)}),
            add_special_tokens=False,
        )
        return await engine.generate(await validated(engine, request, stream=False))

    result = demo_grpc_server.call(run())
    person = json.loads(result.generated_text)
    jsonschema.validate(person, PERSON)
    assert result.finish_reason.value == "eos_token" and result.num_generated_tokens < 60
    assert person["age"] == 31 and "Alice" in person["name"]

"""Every default of a request, decided here once, per API. The converters read these names.

| what                         | TGI (`/generate`, gRPC)              | OpenAI chat        | OpenAI completions |
|------------------------------|--------------------------------------|--------------------|--------------------|
| output length (absent)       | what fits: max_total_tokens - prompt | what fits          | 16                 |
| sampling (absent)            | greedy, unless a warper is given     | samples at T=1     | samples at T=1     |
| temperature 0                | refused (TGI: strictly positive)     | greedy             | greedy             |
| top_p 1                      | refused (TGI: < 1)                   | off                | off                |
| seed (absent)                | drawn at random (u64)                | drawn; choice i+1.. fresh | drawn       |
| stop text in the output      | kept                                 | stripped           | stripped           |
| return_full_text (absent)    | false; `/`: true for text-generation | –                  | –                  |

Responses and Anthropic Messages requests are chat requests in other shapes (converted, then planned
as chat), so chat's column is theirs; Anthropic's `max_tokens` is required. `tests/unit/
test_parameter_walk.py` walks temperature and the output length from each API to the sampler.

The typed client (`textgen_client`) sends `max_new_tokens=20` unless told otherwise, as TGI's own
Python client does: that is the client's choice, not a server default.
"""

from __future__ import annotations

# None: generate up to the context (`max_total_tokens` minus the prompt); an int: that many tokens.
TGI_MAX_NEW_TOKENS: int | None = None
CHAT_MAX_NEW_TOKENS: int | None = None
COMPLETION_MAX_NEW_TOKENS: int | None = 16
# OpenAI's sampling temperature when the request gives none; 0 means greedy.
OPENAI_TEMPERATURE = 1.0

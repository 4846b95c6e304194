"""The request front end: every API's request (TGI, OpenAI) becomes the engine's one neutral
`EngineRequest` here, with chat templates, tokenization, validation and every default decided once."""

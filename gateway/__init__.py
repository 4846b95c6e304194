"""The REST gateway: a real Envoy whose gRPC-JSON transcoder serves TGI's REST API over the gRPC one.

`config` renders Envoy's config from the server's flags, `tgi.lua` shapes the transcoded JSON into
TGI's, `envoy` runs and supervises the process, `launch` starts the server and Envoy together.
"""

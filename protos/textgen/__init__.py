"""The public API's generated modules (`make protos`; never edited by hand).

`textgen.v1.generate_pb2` holds the messages, `textgen.v1.generate_pb2_grpc` the service stubs, and
`DESCRIPTOR_SET` the compiled protos (imports and comments included) for Envoy's transcoder.
"""

from pathlib import Path

DESCRIPTOR_SET = Path(__file__).with_name("textgen.pb")

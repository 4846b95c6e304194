"""Hypothesis strategies for any protobuf message, read from its descriptor: every field of every
type, with values a careless or hostile caller sends (huge, negative-as-unsigned, NaN, infinities,
empty, long and odd Unicode strings), nested messages and google.protobuf.Value / Struct included.
Fields are often left unset, as callers do."""

from __future__ import annotations

from google.protobuf import descriptor, struct_pb2
from google.protobuf.message import Message
from hypothesis import strategies as st

FD = descriptor.FieldDescriptor
_I32, _U32, _I64, _U64 = (-(2**31), 2**31 - 1), (0, 2**32 - 1), (-(2**63), 2**63 - 1), (0, 2**64 - 1)
_INTS = {
    FD.TYPE_INT32: _I32,
    FD.TYPE_SINT32: _I32,
    FD.TYPE_SFIXED32: _I32,
    FD.TYPE_UINT32: _U32,
    FD.TYPE_FIXED32: _U32,
    FD.TYPE_INT64: _I64,
    FD.TYPE_SINT64: _I64,
    FD.TYPE_SFIXED64: _I64,
    FD.TYPE_UINT64: _U64,
    FD.TYPE_FIXED64: _U64,
}
# Small values matter most (they pass validation and reach the engine), extremes second.
_SMALL = st.integers(-3, 40)
TEXT = st.one_of(
    st.text(max_size=40),
    st.sampled_from(
        ["", " ", "\x00", "😀" * 30, "a" * 3000, "{", "\ud7ff", "json", "regex", "json_schema", "auto", "none"]
    ),
)


def _json_values(depth: int) -> st.SearchStrategy:
    scalars = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=False, allow_infinity=False), TEXT)
    if depth <= 0:
        return scalars
    return st.one_of(
        scalars,
        st.lists(_json_values(depth - 1), max_size=3),
        st.dictionaries(TEXT, _json_values(depth - 1), max_size=3),
    )


def _scalar(field: FD) -> st.SearchStrategy:
    if field.type in _INTS:
        low, high = _INTS[field.type]
        return st.one_of(_SMALL.filter(lambda v: low <= v <= high), st.integers(low, high))
    if field.type in (FD.TYPE_FLOAT, FD.TYPE_DOUBLE):
        return st.one_of(st.floats(-2, 2, width=32), st.floats(width=32 if field.type == FD.TYPE_FLOAT else 64))
    if field.type == FD.TYPE_BOOL:
        return st.booleans()
    if field.type == FD.TYPE_STRING:
        return TEXT
    if field.type == FD.TYPE_BYTES:
        return st.binary(max_size=64)
    if field.type == FD.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values])
    raise TypeError(f"no strategy for field type {field.type}")


def _value(field: FD, depth: int, density: float) -> st.SearchStrategy:
    if field.type == FD.TYPE_MESSAGE:
        return messages(field.message_type, depth - 1, density)
    return _scalar(field)


@st.composite
def _message(draw, message_descriptor: descriptor.Descriptor, depth: int, density: float) -> Message:
    from google.protobuf import message_factory

    message = message_factory.GetMessageClass(message_descriptor)()
    if message_descriptor.full_name == "google.protobuf.Value":
        struct = struct_pb2.Struct()
        struct.update({"v": draw(_json_values(2))})
        message.CopyFrom(struct.fields["v"])
        return message
    if message_descriptor.full_name == "google.protobuf.Struct":
        message.update(draw(st.dictionaries(TEXT, _json_values(2), max_size=4)))
        return message
    for field in message_descriptor.fields:
        # Set with probability ~density (hypothesis leans to small integers: those mean "unset").
        if draw(st.integers(0, 99)) < 100 - 100 * density or (field.type == FD.TYPE_MESSAGE and depth <= 0):
            continue  # left unset
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key_field = field.message_type.fields_by_name["key"]
            value_field = field.message_type.fields_by_name["value"]
            entries = draw(st.dictionaries(_scalar(key_field), _value(value_field, depth, density), max_size=3))
            for key, value in entries.items():
                target = getattr(message, field.name)
                if value_field.type == FD.TYPE_MESSAGE:
                    target[key].CopyFrom(value)
                else:
                    target[key] = value
        elif field.is_repeated:
            getattr(message, field.name).extend(draw(st.lists(_value(field, depth, density), max_size=3)))
        elif field.type == FD.TYPE_MESSAGE:
            getattr(message, field.name).CopyFrom(draw(messages(field.message_type, depth - 1, density)))
        else:
            setattr(message, field.name, draw(_scalar(field)))
    return message


def messages(
    message_descriptor: descriptor.Descriptor, depth: int = 3, density: float = 0.5
) -> st.SearchStrategy[Message]:
    """Messages with each field set with probability `density`."""
    return _message(message_descriptor, depth, density)


def mutations(base: Message, density: float = 0.15) -> st.SearchStrategy[Message]:
    """A valid request with a few fields overwritten (repeated ones extended): these get past
    validation more often and reach the engine."""

    def merged(changes: Message) -> Message:
        message = type(base)()
        message.CopyFrom(base)
        message.MergeFrom(changes)
        return message

    return messages(base.DESCRIPTOR, density=density).map(merged)

"""Why a request's bytes do not parse as its protobuf message, naming the field (no gRPC import).

protobuf refuses a whole message when one ``string`` field holds bytes that are not UTF-8 (proto3
strings are UTF-8 text), and its DecodeError names only the message type. ``explain`` walks the
protobuf wire format itself, guided by the message descriptor, to find the first such field and
give its path the way the gateway names fields: ``messages[0].content``, ``stop[1]``, ``text``.

The walk reads the four wire types proto3 uses (varint 0, fixed64 1, length-delimited 2, fixed32 5);
it recurses into message fields and checks string fields, and skips everything else, unknown field
numbers included.
"""
from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor


def _varint(data: bytes, i: int) -> tuple[int, int]:
    """(value, next offset) of the base-128 varint at data[i]; ValueError when it runs off the end
    or is longer than 10 bytes."""
    value = shift = 0
    for n in range(10):
        if i + n >= len(data):
            raise ValueError("truncated varint")
        b = data[i + n]
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i + n + 1
        shift += 7
    raise ValueError("varint longer than 10 bytes")


def _repeated(field: FieldDescriptor) -> bool:
    flag = getattr(field, "is_repeated", None)   # protobuf >= 5.28; `label` before (removed in 7)
    return bool(flag) if flag is not None else field.label == FieldDescriptor.LABEL_REPEATED


def bad_utf8_field(desc: Descriptor, data: bytes, prefix: str = "") -> tuple[str, int, int] | None:
    """The first string field of ``data`` (a serialized ``desc``) whose bytes are not UTF-8.

    Args:
        desc: the message's descriptor.
        data: its wire bytes.
        prefix: the path of ``desc`` inside an enclosing message ("messages[0].").
    Returns:
        (field path, 1-based offset of the first bad byte in the field, that byte), or None when
        every string field is UTF-8 or the bytes are not wire format this walk can follow.
    """
    seen: dict[int, int] = {}
    i = 0
    try:
        while i < len(data):
            key, i = _varint(data, i)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, i = _varint(data, i)
            elif wire_type == 1:
                i += 8
            elif wire_type == 5:
                i += 4
            elif wire_type == 2:
                n, i = _varint(data, i)
                chunk, i = data[i:i + n], i + n
                if i > len(data):
                    return None
                field = desc.fields_by_number.get(number)
                if field is None:
                    continue
                index = seen.get(number, 0)
                seen[number] = index + 1
                path = prefix + field.name + (f"[{index}]" if _repeated(field) else "")
                if field.type == FieldDescriptor.TYPE_STRING:
                    try:
                        chunk.decode("utf-8")
                    except UnicodeDecodeError as exc:
                        return path, exc.start + 1, chunk[exc.start]
                elif field.type == FieldDescriptor.TYPE_MESSAGE:
                    found = bad_utf8_field(field.message_type, chunk, path + ".")
                    if found is not None:
                        return found
            else:   # groups (proto2) or a corrupt key
                return None
    except ValueError:
        return None
    return None


def explain(desc: Descriptor, data: bytes, error: Exception) -> str:
    """A client-facing message for bytes that protobuf refused to parse as ``desc``.

    Names the field and the bad byte when a string field is not UTF-8, else says the bytes are
    not the message's wire format (with protobuf's own words)."""
    found = bad_utf8_field(desc, data)
    if found is not None:
        path, offset, byte = found
        return (f"{path} is not valid UTF-8 (byte {offset} of the field is 0x{byte:02x}): "
                f"protobuf string fields carry UTF-8 text only")
    return (f"the request is not a valid {desc.full_name} ({len(data)} bytes; protobuf: "
            f"{error}): is the client built from this server's protos?")

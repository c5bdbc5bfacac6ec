"""An independent reader of TensorBoard event files, for the tests.

Written from the published framing (TFRecord: length, masked CRC-32C of the length, data,
masked CRC-32C of the data) and the Event / Summary protocol buffer field numbers, decoding
the wire format by hand. Prints JSON: {"version": str, "events": [{"step", "wall_time",
"values": {tag: float}}], "tail": "ok" | "truncated" | "bad crc at record N"}.
Usage: tfevents_reader.py FILE
"""
import json
import struct
import sys


def crc32c(data):
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def masked(data):
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def varint(buf, i):
    shift = value = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def fields(buf):
    """(field number, wire type, value) of a message; length-delimited values as bytes."""
    i = 0
    while i < len(buf):
        key, i = varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = varint(buf, i)
        elif wire == 1:
            value, i = buf[i:i + 8], i + 8
        elif wire == 2:
            n, i = varint(buf, i)
            value, i = buf[i:i + n], i + n
        elif wire == 5:
            value, i = buf[i:i + 4], i + 4
        else:
            raise ValueError("wire type %d" % wire)
        yield number, wire, value


def decode_event(buf):
    event = {"step": 0, "wall_time": None, "values": {}, "version": None}
    for number, wire, value in fields(buf):
        if number == 1 and wire == 1:
            event["wall_time"] = struct.unpack("<d", value)[0]
        elif number == 2 and wire == 0:
            event["step"] = value - (1 << 64) if value >= 1 << 63 else value
        elif number == 3 and wire == 2:
            event["version"] = value.decode()
        elif number == 5 and wire == 2:  # Summary
            for n2, w2, v2 in fields(value):
                if n2 != 1 or w2 != 2:
                    continue
                tag, simple = None, None
                for n3, w3, v3 in fields(v2):  # Summary.Value
                    if n3 == 1 and w3 == 2:
                        tag = v3.decode()
                    elif n3 == 2 and w3 == 5:
                        simple = struct.unpack("<f", v3)[0]
                event["values"][tag] = simple
    return event


def read(path):
    data = open(path, "rb").read()
    out = {"version": None, "events": [], "tail": "ok"}
    i = 0
    n = 0
    while i < len(data):
        if len(data) - i < 12:
            out["tail"] = "truncated"
            break
        header = data[i:i + 8]
        (length,) = struct.unpack("<Q", header)
        (crc_len,) = struct.unpack("<I", data[i + 8:i + 12])
        if crc_len != masked(header):
            out["tail"] = "bad crc at record %d" % n
            break
        if len(data) - i - 12 < length + 4:
            out["tail"] = "truncated"
            break
        body = data[i + 12:i + 12 + length]
        (crc_body,) = struct.unpack("<I", data[i + 12 + length:i + 16 + length])
        if crc_body != masked(body):
            out["tail"] = "bad crc at record %d" % n
            break
        event = decode_event(body)
        if event["version"] is not None:
            out["version"] = event["version"]
        else:
            out["events"].append({k: event[k] for k in ("step", "wall_time", "values")})
        i += 16 + length
        n += 1
    return out


if __name__ == "__main__":
    json.dump(read(sys.argv[1]), sys.stdout)

#!/usr/bin/env python3
"""tests/tools/wandb_offline_read.py RUN_FILE: prints the history rows and config of a W&B offline run file
(run-*.wandb: a 7-byte header, then LevelDB-log records of 32 KiB blocks holding wandb's Record protobufs),
read independently of wandb's own readers, as JSON: {"history": [{key: value}], "config": {key: value}}."""
import json
import struct
import sys

from wandb.proto import wandb_internal_pb2 as pb

BLOCK = 32768


def records(data):
    if data[:4] != b":W&B":
        sys.exit(f"not a W&B run file (header {data[:4]!r})")
    pos, part = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        if kind == 1:  # FULL
            yield chunk
        elif kind == 2:  # FIRST
            part = chunk
        elif kind == 3:  # MIDDLE
            part += chunk
        elif kind == 4:  # LAST
            yield part + chunk
            part = b""


def main():
    with open(sys.argv[1], "rb") as f:
        data = f.read()
    history, config = [], {}
    for raw in records(data):
        r = pb.Record()
        r.ParseFromString(raw)
        kind = r.WhichOneof("record_type")
        if kind == "history":
            history.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item})
        elif kind == "config":
            for i in r.config.update:
                config[i.key] = json.loads(i.value_json)
        elif kind == "run":
            for i in r.run.config.update:
                config[i.key] = json.loads(i.value_json)
    print(json.dumps({"history": history, "config": config}))


if __name__ == "__main__":
    main()

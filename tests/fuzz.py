"""A seeded message fuzzer for rlcli's ZeroMQ endpoints (loopback only, bounded in count and time).

Messages are drawn from four families: random bytes, valid messages of every type with their bytes
mutated (flips, truncation, splicing), valid messages whose decoded fields are replaced by values of
the wrong type or out of range, and envelopes with unknown types, other protocol versions or
oversized payloads. ``shutdown`` is never sent: a well-formed one legitimately stops a server.
"""

import math
import random
import time

import msgspec
import zmq

from rlcli.protocol import PROTOCOL_VERSION

VALID = [
    {"type": "generate", "request_id": "g", "prompt_ids": [1, 2, 3],
     "sampling": {"temperature": 1.0, "top_p": 1.0, "max_tokens": 4, "n": 1, "stop_token_ids": [],
                  "ignore_eos": False, "seed": 1, "return_routing": False}, "cache_salt": "s"},
    {"type": "health", "request_id": "h"},
    {"type": "abort", "request_ids": ["g", "x"]},
    {"type": "load_weights", "request_id": "l", "version": 3, "weights": {"type": "fs", "path": "/nonexistent"}},
    {"type": "load_weights", "request_id": "n", "version": 3,  # tensors whose dtype and shape fit no model
     "weights": {"type": "nccl", "group": "g", "store": "127.0.0.1:1", "rank": 1, "world_size": 2,
                 "tensors": [{"name": "model.embed_tokens.weight", "dtype": "float8_e4m3fn", "shape": [3, 3]}],
                 "bucket_bytes": 64, "timeout_s": 0.5}},
    {"type": "cache_put", "request_id": "p", "keys": [b"k1", b"k2"], "values": [b"v1", b"v2"]},
    {"type": "cache_put", "request_id": "m", "keys": [b"k3"], "values": [b"\x00" * 12],  # 12 bytes, meta says 16
     "meta": {"fingerprint": "f", "dtype": "float32", "shape": [2, 2]}},
    {"type": "cache_list", "request_id": "ls", "limit": 5},
    {"type": "cache_get", "request_id": "q", "keys": [b"k1", b"zz"]},
    {"type": "cache_exists", "request_id": "e", "keys": [b"k1"]},
    {"type": "cache_stats", "request_id": "c"},
    {"type": "cache_get", "request_id": "a", "keys": [b"k1"], "transfer": "arena",
     "meta": {"fingerprint": "f", "dtype": "float32", "shape": [2, 2]}},
    {"type": "cache_reserve", "request_id": "rv", "keys": [b"k4"],
     "meta": {"fingerprint": "f", "dtype": "float32", "shape": [2, 2]}},
    {"type": "cache_put", "request_id": "cm", "keys": [b"k4"], "lease": 1,
     "meta": {"fingerprint": "f", "dtype": "float32", "shape": [2, 2]}},
    {"type": "cache_release", "request_id": "rl", "lease": 2},
    {"type": "generate_response", "request_id": "r", "completions": [], "num_prompt_tokens": 1},
    {"type": "policy_updated", "version": 1},
]

WEIRD = [None, True, -1, 0, 2**31, 2**63 - 1, -2**63, 1e308, -1e308, math.nan, math.inf, "", "x" * 1000,
         b"\x00" * 7, [], [None], [-5, 10**9], {}, {"a": 1}, [[1, 2], [3]], 0.5, -0.0]


def _with_protocol(msg: dict) -> dict:
    return {**msg, "protocol": PROTOCOL_VERSION}


def _mutate_fields(rng: random.Random, msg: dict) -> dict:
    out = _with_protocol(msg)
    for _ in range(rng.randint(1, 3)):
        target = out
        nested = [k for k, v in out.items() if isinstance(v, dict) and v]  # sampling, weights
        if nested and rng.random() < 0.5:
            k = rng.choice(nested)
            target = out[k] = dict(out[k])
        key = rng.choice(list(target))
        if key in ("type", "protocol") and rng.random() < 0.7:
            continue  # mostly keep the message decodable up to its fields
        target[key] = rng.choice(WEIRD)
    if rng.random() < 0.2:
        out[f"extra_{rng.randint(0, 9)}"] = rng.choice(WEIRD)
    return out


def _mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    kind = rng.randrange(3)
    if kind == 0 and b:
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif kind == 1:
        b = b[:rng.randrange(len(b) + 1)]
    else:
        other = msgspec.msgpack.encode(_with_protocol(rng.choice(VALID)))
        b = b[:rng.randrange(len(b) + 1)] + other[rng.randrange(len(other) + 1):]
    return bytes(b)


def messages(seed: int, count: int, oversized_bytes: int):
    """``count`` payloads (bytes) drawn from the four families."""
    rng = random.Random(seed)
    encode = msgspec.msgpack.Encoder().encode
    for i in range(count):
        family = rng.randrange(10)
        if i % 2500 == 1249:  # a few oversized messages, not thousands
            yield encode({"type": "cache_put", "protocol": PROTOCOL_VERSION, "request_id": "big",
                          "keys": [b"k"], "values": [b"\x00" * oversized_bytes]})
        elif family == 0:
            yield rng.randbytes(rng.randint(0, 64))
        elif family <= 3:
            yield _mutate_bytes(rng, encode(_with_protocol(rng.choice(VALID))))
        elif family <= 7:
            yield encode(_mutate_fields(rng, rng.choice(VALID)))
        elif family == 8:
            msg = _with_protocol(rng.choice(VALID))
            msg["type" if rng.random() < 0.5 else "protocol"] = rng.choice(
                ["nope", "shutdownx", 0, PROTOCOL_VERSION + 1, -1, None])
            yield encode(msg)
        else:
            yield encode(_mutate_fields(rng, rng.choice(VALID)))


QUIET_S = 5.0


def blast(endpoint: str, seed: int, count: int, oversized_bytes: int, timeout_s: float = 300) -> dict:
    """Send ``count`` fuzzed messages from a DEALER, draining replies as they come; returns counts."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(endpoint)
    sent = replies = errors = 0
    deadline = time.monotonic() + timeout_s
    try:
        for payload in messages(seed, count, oversized_bytes):
            if time.monotonic() > deadline:
                raise AssertionError(f"fuzzing {endpoint} ran past {timeout_s}s after {sent} messages")
            sock.send(payload)
            sent += 1
            while sock.poll(0):
                reply = msgspec.msgpack.decode(sock.recv())
                replies += 1
                errors += reply.get("type") == "error"
        # Let the server work through its queue: until it has been quiet for QUIET_S (a loaded 2-core
        # machine can pause a server for a second or two).
        quiet_until = time.monotonic() + QUIET_S
        while time.monotonic() < min(quiet_until, deadline):
            if sock.poll(200):
                reply = msgspec.msgpack.decode(sock.recv())
                replies += 1
                errors += reply.get("type") == "error"
                quiet_until = time.monotonic() + QUIET_S
    finally:
        sock.close(linger=0)
    return {"sent": sent, "replies": replies, "errors": errors}

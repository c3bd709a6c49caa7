"""The control plane's messages, which carry data and never code. Every value in the store is
JSON. It is checked on arrival against the form it must have, and it is signed when the group
has a shared secret.

The store is a plain TCP key-value server: anyone who reaches its port can read and write it.
So nothing read from the store is unpickled or imported. A dtype is looked up in a fixed table,
a shared-memory name must have the form our senders give it, and a number must be an int in
range. A message that fails these checks raises `MalformedMessageError` naming the key, and no
part of it is used.

With a secret, each value is `HMAC-SHA256(session key, store key, payload) || payload`. The
session key mixes the secret with a random nonce from the sender and one from every receiver,
all fresh for this group. So a message is accepted only under the store key it was written
for, and only in this group. A forged message, or one replayed from another key or an earlier
group, raises `ForgedMessageError`. A receiver proves that it knows the secret when it joins.
"""

import base64
import hashlib
import hmac
import json
import re
from collections.abc import Callable

import torch

from ferrule_weightsync.errors import ForgedMessageError, MalformedMessageError

MAX_MESSAGE_BYTES = 64 << 20  # a layout of a million tensors fits; a hostile blob does not
MAX_TENSORS = 1 << 20
MAX_DIMS = 16
MAX_BUCKET_BYTES = 1 << 40
MAX_INT = (1 << 63) - 1
NONCE_BYTES = 16
MAC_BYTES = 32

# The dtypes a tensor may have on the wire, by name. A received name that is not in this table is
# refused, because getattr(torch, name) on a name from the network could reach anything in torch.
DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.complex128, torch.complex64,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
        torch.float8_e4m3fn, torch.float8_e5m2,
    )
}  # fmt: skip
_SHM_NAME = re.compile(r"ferrule-ws-[0-9a-f]{16}")
_LAYOUT_KEY = re.compile(r"layout[0-9]{1,9}")


# -- bytes -------------------------------------------------------------------------------------


def encode(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


def decode(raw: bytes, key: str) -> object:
    if len(raw) > MAX_MESSAGE_BYTES:
        raise MalformedMessageError(f"control message {key}: {len(raw)} bytes is too large")
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as error:
        raise MalformedMessageError(f"control message {key} is not JSON: {error}") from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number a control message may hold")


class Seal:
    """Signs and checks values with a session key. Without a key, it passes values through."""

    def __init__(self, key: bytes | None = None):
        self.key = key

    def close(self, store_key: str, payload: bytes) -> bytes:
        if self.key is None:
            return payload
        return self._mac(store_key, payload) + payload

    def open(self, store_key: str, raw: bytes) -> bytes:
        if self.key is None:
            return raw
        mac, payload = raw[:MAC_BYTES], raw[MAC_BYTES:]
        if len(raw) < MAC_BYTES or not hmac.compare_digest(mac, self._mac(store_key, payload)):
            raise ForgedMessageError(
                f"control message {store_key} fails its signature check: it was forged or "
                "replayed, or its writer has another secret"
            )
        return payload

    def _mac(self, store_key: str, payload: bytes) -> bytes:
        return hmac.new(self.key, store_key.encode() + b"\0" + payload, hashlib.sha256).digest()


def session_key(secret: bytes, sender_nonce: bytes, receiver_nonces: list[bytes]) -> bytes:
    material = b"ferrule-weightsync session\0" + sender_nonce + b"".join(receiver_nonces)
    return hmac.new(secret, material, hashlib.sha256).digest()


def join_proof(secret: bytes, rank: int, sender_nonce: bytes, receiver_nonce: bytes) -> bytes:
    """The proof that receiver `rank` sends to show it knows the secret. The proof is fresh for
    each group because it includes the sender's nonce."""
    material = f"ferrule-weightsync join {rank}\0".encode() + sender_nonce + receiver_nonce
    return hmac.new(secret, material, hashlib.sha256).digest()


def as_secret(secret: str | bytes | None) -> bytes | None:
    if secret is None:
        return None
    secret = secret.encode() if isinstance(secret, str) else bytes(secret)
    if len(secret) < 16:
        raise ValueError(f"a weight-sync secret must be at least 16 bytes, got {len(secret)}")
    return secret


def to_b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def from_b64(value: object, key: str, what: str, size: int | None = None) -> bytes:
    text = _typed(value, str, key, what)
    try:
        data = base64.b64decode(text, validate=True)
    except ValueError:
        raise MalformedMessageError(f"control message {key}: {what} is not base64") from None
    if size is not None and len(data) != size:
        raise MalformedMessageError(f"control message {key}: {what} must be {size} bytes")
    return data


# -- checks ------------------------------------------------------------------------------------


def _typed(value: object, kind: type, key: str, what: str):
    # bool is an int in Python; a count or size that arrives as true/false is malformed
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise MalformedMessageError(
            f"control message {key}: {what} must be {_JSON_NAMES[kind]}, "
            f"got {_JSON_NAMES.get(type(value), type(value).__name__)}"
        )
    return value


_JSON_NAMES = {
    int: "an integer", str: "a string", dict: "an object", list: "an array", bool: "a boolean",
    float: "a float", type(None): "null",
}  # fmt: skip


def integer(value: object, key: str, what: str, low: int = 0, high: int = MAX_INT) -> int:
    _typed(value, int, key, what)
    if not low <= value <= high:
        raise MalformedMessageError(f"control message {key}: {what} {value} not in [{low}, {high}]")
    return value


def fields(value: object, key: str, required: dict[str, Callable]) -> dict:
    """Check that `value` is a JSON object with exactly the `required` fields, and check each
    field with its function, called as check(value, key, field name). Returns the checked fields."""
    _typed(value, dict, key, "the message")
    if set(value) != set(required):
        raise MalformedMessageError(
            f"control message {key}: fields {sorted(value)}, expected {sorted(required)}"
        )
    return {name: check(value[name], key, name) for name, check in required.items()}


def text(value, key, what="the message") -> str:
    return _typed(value, str, key, what)


def mapping(value, key, what) -> dict:
    return _typed(value, dict, key, what)


def flag(value, key, what) -> bool:
    return _typed(value, bool, key, what)


def shm_name(value, key, what) -> str:
    """Check that `value` is a shared-memory segment name of the form our senders create, so
    that it is never a path."""
    if not isinstance(value, str) or not _SHM_NAME.fullmatch(value):
        raise MalformedMessageError(f"control message {key}: {what} {value!r:.80} is not ours")
    return value


def layout_key(value, key, what) -> str:
    if not isinstance(value, str) or not _LAYOUT_KEY.fullmatch(value):
        raise MalformedMessageError(f"control message {key}: {what} {value!r:.80} is not a layout")
    return value


def dtype(value, key, what) -> torch.dtype:
    if not isinstance(value, str) or value not in DTYPES:
        raise MalformedMessageError(
            f"control message {key}: {what} {value!r:.80} is not one of {sorted(DTYPES)}"
        )
    return DTYPES[value]


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"weight sync cannot send tensors of dtype {dtype}")
    return name


def shape(value, key, what) -> tuple[int, ...]:
    _typed(value, list, key, what)
    if len(value) > MAX_DIMS:
        raise MalformedMessageError(f"control message {key}: {what} has {len(value)} dimensions")
    return tuple(integer(size, key, what) for size in value)


def checksum(value, key) -> tuple[int, int]:
    _typed(value, list, key, "the checksum")
    if len(value) != 2:
        raise MalformedMessageError(f"control message {key}: a checksum is two numbers")
    return tuple(integer(part, key, "the checksum", -MAX_INT, MAX_INT) for part in value)

"""Wire format of the KV transfer: length-prefixed frames of a JSON header and raw tensor bytes.

    frame = !II (header length, payload length) | header (UTF-8 JSON) | payload

Headers carry `kind`: `hello` (room, sender), `layer` (layer index, first token index, dtype, shape),
`heartbeat`, `done` (first token and metadata), `error` (message). One connection carries one room.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import torch

_PREFIX = struct.Struct("!II")
MAX_HEADER_BYTES = 1 << 16
MAX_PAYLOAD_BYTES = 1 << 34

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}


class ProtocolError(Exception):
    pass


@dataclass
class Frame:
    header: dict[str, Any]
    payload: bytes = b""

    @property
    def kind(self) -> str:
        return str(self.header.get("kind"))


def encode_frame(header: dict[str, Any], payload: bytes | memoryview = b"") -> list[bytes | memoryview]:
    """Buffers to write in order (the payload is not copied)."""
    encoded = json.dumps(header, separators=(",", ":")).encode()
    return [_PREFIX.pack(len(encoded), len(payload)), encoded, payload]


def decode_prefix(prefix: bytes) -> tuple[int, int]:
    header_len, payload_len = _PREFIX.unpack(prefix)
    if header_len > MAX_HEADER_BYTES or payload_len > MAX_PAYLOAD_BYTES:
        raise ProtocolError(f"frame too large: header {header_len} B, payload {payload_len} B")
    return header_len, payload_len


PREFIX_BYTES = _PREFIX.size


def tensor_payload(tensor: torch.Tensor) -> tuple[dict[str, Any], memoryview]:
    """The header fields and a zero-copy byte view of a CPU tensor."""
    tensor = tensor.detach().contiguous().cpu()
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise ProtocolError(f"unsupported KV dtype {dtype}; supported: {', '.join(_DTYPES)}")
    raw = tensor.view(torch.uint8).numpy() if tensor.numel() else torch.empty(0, dtype=torch.uint8).numpy()
    return {"dtype": dtype, "shape": list(tensor.shape)}, memoryview(raw).cast("B")


def payload_tensor(header: dict[str, Any], payload: bytes | bytearray) -> torch.Tensor:
    """A tensor over the payload's memory (no copy when it is a bytearray)."""
    try:
        dtype = _DTYPES[header["dtype"]]
        shape = [int(n) for n in header["shape"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"malformed tensor header {header!r}") from exc
    buffer = payload if isinstance(payload, bytearray) else bytearray(payload)
    if not buffer:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)

"""PATCH_XOR: a patch as gap-coded positions and byte planes of XOR values (the reference).

Why: RL steps move 1-5% of bf16 elements, mostly by one ulp. Each change's XOR (new ^ old bits)
is then one low byte, the high byte nearly always zero, and the gaps between changed positions
fit a one-byte varint: about 2.3 bytes per changed bf16 element, against 4 with uint16 gaps.

Byte layout (all of it; the patch's length is TensorSpec.size_bytes):

    [index kind: 1 byte][index section][plane kinds: itemsize bytes][plane 0 data]...[plane itemsize-1 data]

  index kind 0 (GAPS)     `count` unsigned LEB128 varints, g0 = p0, gk = pk - p(k-1) - 1
  index kind 1 (BITMASK)  ceil(numel/8) bytes, bit j of byte b (LSB first) marks element 8b+j
  x_k = bits(new[p_k]) ^ bits(base[p_k]); plane j = byte j (little-endian) of every x_k
  plane kind 0 (ZERO)     no bytes: every byte of the plane is 0
  plane kind 1 (DENSE)    `count` bytes, in k order
  plane kind 2 (SPARSE)   ceil(count/8) bitmap bytes (bit k set when x_k's byte j is nonzero, LSB
                          first, bits past count 0), then one byte per set bit, in k order

The encoder picks the bitmask only when it is strictly smaller, and per plane the smallest kind
(ties: the lower kind number). A decoder accepts any choice. It refuses, checking in this order:
  1. count outside [0, numel]                                  -> PATCH_COUNT_MISMATCH
  2. the structure, front to back (PATCH_MALFORMED): the index kind byte missing or unknown; a
     varint running past the end, longer than 10 bytes or over int64; the bitmask cut short;
     plane kinds missing or unknown; plane data cut short; a sparse bitmap bit set past count;
     bytes left over
  3. the index: bitmask bits set past numel (PATCH_INDEX_OUT_OF_RANGE), bitmask bits != count
     (PATCH_COUNT_MISMATCH), a gap-coded position >= numel (PATCH_INDEX_OUT_OF_RANGE)
Not refused (harmless, and cheaper not to look): a zero XOR value, a non-minimal varint, a DENSE
plane of zeros, a SPARSE bit whose byte is 0.

This module is the spec, in numpy and plain Python: simple and O(numel) where that is simpler
(its WS64 is common.checksum.ws64 of whole tensors). common.patch_kernels is the fast version,
tested against it bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch

from weightsync.common.checksum import ws64
from weightsync.common.errors import InvalidArgument

INDEX_GAPS, INDEX_BITMASK = 0, 1
PLANE_ZERO, PLANE_DENSE, PLANE_SPARSE = 0, 1, 2
MALFORMED = "PATCH_MALFORMED"
OUT_OF_RANGE = "PATCH_INDEX_OUT_OF_RANGE"
COUNT_MISMATCH = "PATCH_COUNT_MISMATCH"
MASK64 = (1 << 64) - 1
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(tensor: torch.Tensor) -> np.ndarray:
    """A flat unsigned numpy view of a CPU tensor's raw bits (shares memory; bool, float8 and
    bfloat16 included)."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    size = flat.element_size()
    return flat.view(_INT[size]).numpy().view(_UINT[size])


def varint(value: int) -> bytes:
    """Unsigned LEB128."""
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode(base: torch.Tensor, new: torch.Tensor) -> tuple[bytes, int, int]:
    """(patch bytes, count, WS64(new) - WS64(base) mod 2^64) for two tensors of one dtype and numel."""
    a, b = bits(base), bits(new)
    assert a.dtype == b.dtype and a.size == b.size
    numel, itemsize = a.size, a.itemsize
    positions = np.flatnonzero(a != b)
    count = positions.size
    gaps = b"".join(varint(int(g)) for g in np.diff(positions, prepend=-1) - 1)
    mask = np.zeros(numel, dtype=bool)
    mask[positions] = True
    bitmask = np.packbits(mask, bitorder="little").tobytes()
    if len(bitmask) < len(gaps):
        index = bytes([INDEX_BITMASK]) + bitmask
    else:
        index = bytes([INDEX_GAPS]) + gaps
    kinds, planes = encode_planes((a ^ b)[positions], itemsize)
    delta = (ws64(new) - ws64(base)) & MASK64
    return index + bytes(kinds) + b"".join(planes), count, delta


def encode_planes(xor: np.ndarray, itemsize: int) -> tuple[list[int], list[bytes]]:
    """Each byte plane of the XOR values in its smallest kind."""
    count = xor.size
    kinds, planes = [], []
    for j in range(itemsize):
        plane = ((xor.astype(np.uint64) >> np.uint64(8 * j)) & np.uint64(0xFF)).astype(np.uint8)
        nonzero = plane != 0
        sparse = np.packbits(nonzero, bitorder="little").tobytes() + plane[nonzero].tobytes()
        options = [(count, PLANE_DENSE, plane.tobytes()), (len(sparse), PLANE_SPARSE, sparse)]
        if not nonzero.any():
            options.append((0, PLANE_ZERO, b""))
        _, kind, body = min(options, key=lambda o: (o[0], o[1]))
        kinds.append(kind)
        planes.append(body)
    return kinds, planes


def refuse(reason: str, tensor: str, message: str) -> InvalidArgument:
    return InvalidArgument(reason, f"tensor {tensor!r}: PATCH_XOR {message}", tensor=tensor)


def decode(data: bytes, numel: int, itemsize: int, count: int, tensor: str = "") -> tuple[np.ndarray, np.ndarray]:
    """(positions int64, XOR values uint of the element's width), or InvalidArgument."""
    data = bytes(data)
    if not 0 <= count <= numel:
        raise refuse(COUNT_MISMATCH, tensor, f"count {count} outside [0, {numel}]")
    # 2. structure, front to back
    if not data:
        raise refuse(MALFORMED, tensor, "has no index kind byte")
    kind, at = data[0], 1
    gaps: list[int] = []
    if kind == INDEX_GAPS:
        for _ in range(count):
            value, shift = 0, 0
            while True:
                if at >= len(data):
                    raise refuse(MALFORMED, tensor, "varint runs past the end")
                byte = data[at]
                at += 1
                value |= (byte & 0x7F) << shift
                shift += 7
                if byte < 0x80:
                    break
                if shift == 70:
                    raise refuse(MALFORMED, tensor, "varint longer than 10 bytes")
            if value >= 1 << 63:
                raise refuse(MALFORMED, tensor, "varint over int64")
            gaps.append(value)
    elif kind == INDEX_BITMASK:
        mask_bytes = -(-numel // 8)
        if at + mask_bytes > len(data):
            raise refuse(MALFORMED, tensor, "bitmask cut short")
        flags = np.unpackbits(np.frombuffer(data, np.uint8, mask_bytes, at), bitorder="little")
        at += mask_bytes
    else:
        raise refuse(MALFORMED, tensor, f"unknown index kind {kind}")
    if at + itemsize > len(data):
        raise refuse(MALFORMED, tensor, "plane kinds cut short")
    kinds, at = list(data[at : at + itemsize]), at + itemsize
    xor = np.zeros(count, dtype=np.uint64)
    for j, plane_kind in enumerate(kinds):
        if plane_kind == PLANE_ZERO:
            continue
        if plane_kind == PLANE_DENSE:
            if at + count > len(data):
                raise refuse(MALFORMED, tensor, f"plane {j} cut short")
            plane = np.frombuffer(data, np.uint8, count, at)
            at += count
        elif plane_kind == PLANE_SPARSE:
            bitmap_bytes = -(-count // 8)
            if at + bitmap_bytes > len(data):
                raise refuse(MALFORMED, tensor, f"plane {j} bitmap cut short")
            nonzero = np.unpackbits(np.frombuffer(data, np.uint8, bitmap_bytes, at), bitorder="little")
            at += bitmap_bytes
            if nonzero[count:].any():
                raise refuse(MALFORMED, tensor, f"plane {j} bitmap sets bits past count")
            nonzero = nonzero[:count].astype(bool)
            set_bits = int(nonzero.sum())
            if at + set_bits > len(data):
                raise refuse(MALFORMED, tensor, f"plane {j} bytes cut short")
            plane = np.zeros(count, dtype=np.uint8)
            plane[nonzero] = np.frombuffer(data, np.uint8, set_bits, at)
            at += set_bits
        else:
            raise refuse(MALFORMED, tensor, f"unknown plane kind {plane_kind} (plane {j})")
        xor |= plane.astype(np.uint64) << np.uint64(8 * j)
    if at != len(data):
        raise refuse(MALFORMED, tensor, f"{len(data) - at} bytes left over")
    # 3. the index
    if kind == INDEX_BITMASK:
        if flags[numel:].any():
            raise refuse(OUT_OF_RANGE, tensor, f"bitmask sets bits past its {numel} elements")
        positions = np.flatnonzero(flags[:numel]).astype(np.int64)
        if positions.size != count:
            raise refuse(COUNT_MISMATCH, tensor, f"bitmask sets {positions.size} bits, count is {count}")
    else:
        positions_list, previous = [], -1
        for gap in gaps:
            previous += gap + 1
            if previous >= numel:
                raise refuse(OUT_OF_RANGE, tensor, f"position {previous} >= numel {numel}")
            positions_list.append(previous)
        positions = np.array(positions_list, dtype=np.int64)
    return positions, xor.astype(_UINT[itemsize])


def apply(data: bytes, target: torch.Tensor, count: int, tensor: str = "") -> None:
    """target's bits ^= the patch's XORs, in place (decoded in full first: nothing written on refusal)."""
    flat = bits(target)
    positions, xor = decode(data, flat.size, flat.itemsize, count, tensor)
    flat[positions] ^= xor


def patched_ws64(data: bytes, live: torch.Tensor, count: int, tensor: str = "") -> int:
    """WS64 of `live` once patched, computed on a copy (live is not written)."""
    copy = live.detach().clone()
    apply(data, copy, count, tensor)
    return ws64(copy)

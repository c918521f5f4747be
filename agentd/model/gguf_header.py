"""Read a GGUF file's header, its scalar metadata and its tensor table, trusting no number in it.

Why our own reader: ``gguf.GGUFReader`` builds a memory-mapped view of every metadata item, and a
tokenizer's 49,152-entry vocab made opening the default model take ~30 s on the 2-core machine;
this one skips arrays and reads only the header (~0.1 s).

Invariant: the reader never reads, skips or loops past what the file holds. Every count and
length in the header is compared with the bytes left before it is used, so a damaged or hostile
header ends in milliseconds in a one-line ``GgufHeaderError`` that names the item, what it claims
and what the file holds (GGUF v2/v3, little-endian). A tensor type without a known block size is a
``ValueError`` that names it (its caller says what to do). What the header means, its model
against its tensors and the file's size, is :mod:`agentd.model.gguf_check`'s. Imports neither
torch nor numpy.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentd.model.load_errors import GgufHeaderError

# Value types of GGUF metadata: struct code per scalar type; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9
# ggml tensor types: name, weights per block, bytes per block.
TENSOR_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
                6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34),
                10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
                13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 30: ("BF16", 1, 2)}
BLOCK_WEIGHTS = {name: weights for name, weights, _ in TENSOR_TYPES.values()}
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_NAME_BYTES = 1024  # of a key or tensor name (llama.cpp's tensor names: 63)
# The fewest bytes one metadata item (key length, value type, a one-byte value) and one tensor
# entry (name length, dim count, one dim, type, offset) take: a count of more than the bytes left
# can hold is refused before its first item is read.
_MIN_ITEM_BYTES = 8 + 4 + 1
_MIN_TENSOR_BYTES = 8 + 4 + 8 + 4 + 8
DAMAGED = "the file is damaged or cut short: download or convert it again"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: the innermost (input) dim first
    type_name: str
    offset: int  # absolute, in bytes
    num_bytes: int


@dataclass(frozen=True)
class GgufIndex:
    """What a GGUF's header says, as read (:mod:`agentd.model.gguf_check` holds it to the file).

    Attributes:
        fields: scalar and string metadata (arrays are skipped; ``array_lengths`` counts them).
        data_start: where the tensor data begins; the table's offsets count from here.
    """

    name: str  # the file's name, for messages
    fields: dict[str, Any]
    tensors: list[TensorInfo]
    array_lengths: dict[str, int]
    alignment: int
    data_start: int
    file_bytes: int


class _Cursor:
    """Reads the header from the file's mapping with its size in hand: no length is used
    unchecked (a mapping, so skipping a tokenizer's 100,000 strings is a loop over offsets)."""

    def __init__(self, data: mmap.mmap, name: str) -> None:
        self.data, self.pos, self.file_bytes, self.name = data, 0, len(data), name

    def left(self) -> int:
        return self.file_bytes - self.pos

    def fail(self, what: str, claim: str) -> GgufHeaderError:
        return GgufHeaderError(f"{self.name}: {what} claims {claim}, but only {self.left():,} "
                               f"bytes of the {self.file_bytes:,}-byte file are left; {DAMAGED}")

    def scalar(self, code: str, what: str) -> Any:
        size = struct.calcsize("<" + code)
        if size > self.left():
            raise GgufHeaderError(f"{self.name}: the header ends inside {what} (the file is "
                                  f"{self.file_bytes:,} bytes); {DAMAGED}")
        value = struct.unpack_from("<" + code, self.data, self.pos)[0]
        self.pos += size
        return value

    def skip(self, num_bytes: int, what: str) -> None:
        if num_bytes > self.left():
            raise self.fail(what, f"{num_bytes:,} bytes")
        self.pos += num_bytes

    def string(self, what: str) -> str:
        length = self.scalar("Q", what)
        if length > self.left():
            raise self.fail(what, f"a string of {length:,} bytes")
        self.pos += length
        return self.data[self.pos - length:self.pos].decode("utf-8", errors="replace")

    def identifier(self, what: str) -> str:
        """A metadata key or tensor name: printable UTF-8 of at most ``MAX_NAME_BYTES`` (so
        every message that shows one stays one line)."""
        length = self.scalar("Q", what)
        if length > self.left():
            raise self.fail(what, f"{length:,} bytes")
        if length > MAX_NAME_BYTES:
            raise GgufHeaderError(f"{self.name}: {what} claims {length:,} bytes; names are at "
                                  f"most {MAX_NAME_BYTES:,}; {DAMAGED}")
        raw = self.data[self.pos:self.pos + length]
        self.pos += length
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        if text is None or not text.isprintable():
            raise GgufHeaderError(f"{self.name}: {what} is {ascii(raw[:40])[1:]}, not a printable "
                                  f"name; {DAMAGED}")
        return text

    def skip_strings(self, count: int, what: str) -> None:
        data, pos, end = self.data, self.pos, self.file_bytes
        length_at = struct.Struct("<Q").unpack_from
        for i in range(count):
            after = pos + 8 + length_at(data, pos)[0] if pos + 8 <= end else end + 1
            if after > end:
                self.pos = pos
                raise self.fail(f"{what}[{i}]", "a string past the end of the file")
            pos = after
        self.pos = pos

    def count(self, what: str, min_item_bytes: int) -> int:
        """A count of items, each at least ``min_item_bytes`` long, that the file can hold."""
        count = self.scalar("Q", what)
        if count * min_item_bytes > self.left():
            raise self.fail(what, f"{count:,} items of at least {min_item_bytes} bytes each")
        return count


def _value(cur: _Cursor, key: str, value_type: int, lengths: dict[str, int]) -> Any:
    """One metadata value; an array is skipped (its length noted) and read as None."""
    if value_type in _SCALARS:
        return cur.scalar(_SCALARS[value_type], key)
    if value_type == _STRING:
        return cur.string(key)
    if value_type != _ARRAY:
        raise GgufHeaderError(f"{cur.name}: metadata {key} has value type {value_type}, which "
                              f"GGUF does not define; {DAMAGED}")
    item_type = cur.scalar("I", key)
    if item_type in _SCALARS:
        count = cur.count(f"{key} (an array)", struct.calcsize("<" + _SCALARS[item_type]))
        cur.skip(count * struct.calcsize("<" + _SCALARS[item_type]), key)
    elif item_type == _STRING:
        count = cur.count(f"{key} (an array of strings)", 8)
        cur.skip_strings(count, key)
    else:  # llama.cpp's reader refuses arrays of arrays too
        raise GgufHeaderError(f"{cur.name}: metadata {key} is an array of value type "
                              f"{item_type}, which GGUF readers do not take; {DAMAGED}")
    lengths[key] = count
    return None


def _tensor(cur: _Cursor, i: int) -> tuple[str, tuple[int, ...], int, int]:
    """One tensor table entry: name, ggml shape, type id, offset within the data."""
    name = cur.identifier(f"the name of tensor {i}")
    num_dims = cur.scalar("I", f"tensor {name}'s dimension count")
    if not 1 <= num_dims <= MAX_DIMS:
        raise GgufHeaderError(f"{cur.name}: tensor {name} claims {num_dims} dimensions; ggml "
                              f"tensors have 1 to {MAX_DIMS}; {DAMAGED}")
    shape = tuple(cur.scalar("Q", f"tensor {name}'s shape") for _ in range(num_dims))
    return name, shape, cur.scalar("I", f"tensor {name}'s type"), \
        cur.scalar("Q", f"tensor {name}'s offset")


def _alignment(fields: dict[str, Any], name: str) -> int:
    alignment = fields.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
        raise GgufHeaderError(f"{name}: general.alignment claims {alignment!r}; GGUF needs a "
                              f"power of two; {DAMAGED}")
    return alignment


def _tensor_info(path: Path, entry: tuple[str, tuple[int, ...], int, int],
                 data_start: int) -> TensorInfo:
    name, shape, type_id, offset = entry
    if type_id not in TENSOR_TYPES:
        raise ValueError(f"{path}: tensor {name} has ggml type {type_id}, unknown here")
    type_name, block_weights, block_bytes = TENSOR_TYPES[type_id]
    count = 1
    for dim in shape:
        count *= dim
    return TensorInfo(name, shape, type_name, data_start + offset,
                      count // block_weights * block_bytes)


def read_index(path: Path) -> GgufIndex:
    """The metadata and tensor table of the GGUF at ``path`` (module docstring)."""
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise GgufHeaderError(f"{path.name} does not begin with GGUF's magic bytes: it is "
                                  "not a GGUF file, or a damaged one; pass a .gguf model")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _read(_Cursor(data, path.name), path)


def _read(cur: _Cursor, path: Path) -> GgufIndex:
    cur.pos = 4  # past the magic
    version = cur.scalar("I", "the version")
    if version not in (2, 3):
        raise GgufHeaderError(f"{path.name}: GGUF version {version}; agentd reads versions 2 "
                              "and 3 (llama.cpp's converter writes 3)")
    num_tensors = cur.scalar("Q", "the tensor count")
    num_fields = cur.count("the metadata count", _MIN_ITEM_BYTES)
    fields: dict[str, Any] = {}
    lengths: dict[str, int] = {}
    for i in range(num_fields):
        key = cur.identifier(f"the key of metadata item {i}")
        value = _value(cur, key, cur.scalar("I", f"{key}'s value type"), lengths)
        if value is not None:
            fields[key] = value
    if num_tensors * _MIN_TENSOR_BYTES > cur.left():
        raise cur.fail("the tensor count",
                       f"{num_tensors:,} tensors of at least {_MIN_TENSOR_BYTES} bytes each")
    entries = [_tensor(cur, i) for i in range(num_tensors)]
    alignment = _alignment(fields, path.name)
    data_start = -(-cur.pos // alignment) * alignment
    tensors = [_tensor_info(path, entry, data_start) for entry in entries]
    return GgufIndex(path.name, fields, tensors, lengths, alignment, data_start, cur.file_bytes)

"""A stored sequence's file: its token ids and every layer's KV state, as one safetensors file.

The prefix store (prefixes.py) writes these into a folder every worker of the host reads, and the
shared store beyond the host hands them between hosts; a reader trusts no file it did not check:
its tensors must be exactly the ids and each layer's state, of the dtype and shape the reader's
runner stores for that many tokens.
"""

import hashlib
import json
import struct
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

SUFFIX = ".safetensors"
# safetensors' names of the dtypes a KV state is kept in.
SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
# The sources a stored KV state is computed by: the engine's Python and the kernels' C++.
ENGINE_DIR = Path(__file__).resolve().parent


class NotASequence(ValueError):
    """A file that is not a stored sequence of this model's runner."""


@contextmanager
def stored_file(path: Path | str) -> Iterator:
    """Open a stored sequence's file for reading; raise NotASequence where it cannot be read whole.

    A missing file raises FileNotFoundError as it is. But another worker may evict or replace the file
    after safetensors opened it: torch maps each tensor by the file's name, and fails with a RuntimeError
    naming the missing file; a file cut short fails in safetensors. Either way the reader skips it.
    """
    try:
        with safe_open(str(path), framework="pt") as file:
            yield file
    except (SafetensorError, RuntimeError) as exc:
        raise NotASequence(f"it could not be read: {exc}") from exc


def sequence_name(ids) -> str:
    """Return the file name a sequence of token ids is stored under."""
    key = ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, dtype=torch.int32)
    return hashlib.sha256(key.numpy().tobytes()).hexdigest()[:32] + SUFFIX


def forward_code_version(engine_dir: Path = ENGINE_DIR) -> str:
    """Return a digest of the code that computes KV state (the engine's sources and torch's version).

    Stored KV state is named by it beside the weights, so a worker running other code (after a
    reload, or another host's older release sharing Redis) never continues from state it did not
    compute the same way.
    """
    digest = hashlib.sha256(torch.__version__.encode())
    for path in sorted([*engine_dir.rglob("*.py"), *(engine_dir / "kernels" / "csrc").iterdir()]):
        digest.update(str(path.relative_to(engine_dir)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def shape_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Return the bytes of a tensor of a shape and dtype."""
    count = dtype.itemsize
    for size in shape:
        count *= size
    return count


def write_sequence(path: Path, ids: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
                   layers: Iterable[Iterable[torch.Tensor]], layer_count: int) -> None:
    """Write a sequence as a safetensors file: its ids, then each layer's KV state (`layer.N` of `shape`),
    each layer given as pieces whose bytes follow each other, written as they come.

    safetensors' own writers take every tensor at once, which would hold a second copy of the
    sequence's whole KV state; the format is a little-endian header length, a JSON header and the
    tensors' bytes in its order, so it is written here piece by piece.
    """
    layer_bytes = shape_bytes(shape, dtype)
    header = {"ids": {"dtype": "I32", "shape": list(ids.shape), "data_offsets": [0, ids.nbytes]}}
    for index in range(layer_count):
        start = ids.nbytes + index * layer_bytes
        header[f"layer.{index}"] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                                    "data_offsets": [start, start + layer_bytes]}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    written = 0
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(encoded)) + encoded)
        file.write(ids.numpy().data)
        for pieces in layers:
            size = 0
            for piece in pieces:
                if piece.dtype != dtype:
                    raise ValueError(f"a layer's KV state is {piece.dtype}, not {dtype}")
                size += piece.nbytes
                file.write(piece.contiguous().view(torch.uint8).numpy().data)
            if size != layer_bytes:
                raise ValueError(f"a layer's KV state is {size} bytes, not {layer_bytes} ({shape})")
            written += 1
    if written != layer_count:
        raise ValueError(f"{written} layers of KV state given, {layer_count} expected")


@dataclass(frozen=True)
class SequenceFormat:
    """What a stored sequence of one runner holds: its layer count, its dtype and each layer's shape by length."""

    layer_count: int
    dtype: torch.dtype
    stored_shape: Callable[[int], tuple[int, ...]]

    def read_ids(self, path: Path | str) -> torch.Tensor:
        """Return a stored sequence's token ids (a copy: no mapping outlives the call), after checking the
        whole file's tensors; raise NotASequence for a file that is not one of this format's."""
        with stored_file(path) as file:
            self._check(file)
            return file.get_tensor("ids").clone()

    def open_layers(self, path: Path | str, ids: torch.Tensor) -> list[torch.Tensor]:
        """Return every layer of a stored sequence whose ids are `ids`, as views of its read-only mapping
        (the mapping lives as long as they do); raise NotASequence if it is not that sequence."""
        with stored_file(path) as file:
            self._check(file)
            if not torch.equal(file.get_tensor("ids"), ids):
                raise NotASequence("its token ids are not the ones it is named for")
            return [file.get_tensor(f"layer.{index}") for index in range(self.layer_count)]

    def _check(self, file) -> None:
        """Refuse a file whose tensors are not exactly ids and layer.0 .. layer.N-1 of this format."""
        expected = {"ids", *(f"layer.{index}" for index in range(self.layer_count))}
        if set(file.keys()) != expected:
            raise NotASequence(f"its tensors are not the ids and {self.layer_count} layers")
        ids = file.get_slice("ids")
        if ids.get_dtype() != "I32" or len(ids.get_shape()) != 1 or ids.get_shape()[0] < 1:
            raise NotASequence("its ids are not a list of int32 token ids")
        shape = list(self.stored_shape(ids.get_shape()[0]))
        dtype = SAFETENSORS_DTYPES[self.dtype]
        for index in range(self.layer_count):
            layer = file.get_slice(f"layer.{index}")
            if layer.get_dtype() != dtype or list(layer.get_shape()) != shape:
                raise NotASequence(f"layer {index} is {layer.get_dtype()} {layer.get_shape()}, not {dtype} {shape}")

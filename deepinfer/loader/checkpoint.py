"""Streaming access to a directory of safetensors shards, one tensor at a time."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"


def tensor_bytes_on_disk(path: str | Path) -> int:
    """The bytes of every tensor in a checkpoint directory's safetensors shards (their headers left out)."""
    total = 0
    for shard in sorted(Path(path).glob("*.safetensors")):
        with open(shard, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    return total

_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
}


class CheckpointError(ValueError):
    """A checkpoint that does not match the model; the message names tensor and file."""


class CheckpointReader:
    """Tensor names -> shard files, from the index's weight_map or by scanning *.safetensors.

    Tensors are read lazily through `safe_open` (memory-mapped); open handles are cached
    per shard so a whole-model pass opens each file once.
    """

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise CheckpointError(f"checkpoint directory {self.dir} does not exist")
        self._handles: dict[str, Any] = {}
        self._mapped: dict[str, torch.Tensor] = {}
        index = self.dir / INDEX_FILE
        if index.is_file():
            self._map = self._from_index(index)
        else:
            self._map = self._from_scan()

    def _from_index(self, index: Path) -> dict[str, str]:
        with open(index) as f:
            data = json.load(f)
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no 'weight_map'")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (self.dir / f).is_file()]
        if missing:
            users = {f: next(n for n, g in weight_map.items() if g == f) for f in missing}
            detail = ", ".join(f"{f} (holds e.g. {users[f]})" for f in missing)
            raise CheckpointError(f"{index.name} in {self.dir} references missing shard file(s): {detail}")
        return dict(weight_map)

    def _from_scan(self) -> dict[str, str]:
        files = sorted(p.name for p in self.dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files and no {INDEX_FILE} in {self.dir}")
        out: dict[str, str] = {}
        for fname in files:
            for name in self._handle(fname).keys():
                if name in out:
                    raise CheckpointError(f"tensor {name} is stored twice: in {out[name]} and {fname}")
                out[name] = fname
        return out

    def _handle(self, fname: str):
        h = self._handles.get(fname)
        if h is None:
            h = safe_open(str(self.dir / fname), framework="pt")
            self._handles[fname] = h
        return h

    def _slice(self, name: str):
        try:
            fname = self._map[name]
        except KeyError:
            raise CheckpointError(f"tensor {name} is not in the checkpoint at {self.dir}") from None
        try:
            return self._handle(fname).get_slice(name)
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"cannot read tensor {name} from {fname}: {e}") from e

    def names(self) -> list[str]:
        return list(self._map)

    def files(self) -> list[str]:
        return sorted(set(self._map.values()))

    def __contains__(self, name: str) -> bool:
        return name in self._map

    def file_of(self, name: str) -> str:
        if name not in self._map:
            raise CheckpointError(f"tensor {name} is not in the checkpoint at {self.dir}")
        return self._map[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        code = self._slice(name).get_dtype()
        if code not in _ST_DTYPES:
            raise CheckpointError(f"tensor {name} in {self.file_of(name)} has unsupported dtype {code}")
        return _ST_DTYPES[code]

    def get(self, name: str, index: tuple | None = None) -> torch.Tensor:
        """The tensor (or `tensor[index]`, reading only that part of the file)."""
        if index is not None:
            return self._slice(name)[index]
        fname = self.file_of(name)
        return self._handle(fname).get_tensor(name)

    def mmap(self, name: str) -> torch.Tensor:
        """A zero-copy, read-only view of the tensor's bytes in its shard (pages load on first touch)."""
        fname = self.file_of(name)
        path = self.dir / fname
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            meta = json.loads(f.read(header_len))[name]
        begin, end = meta["data_offsets"]
        whole = self._mapped.get(fname)
        if whole is None:
            whole = torch.from_file(str(path), shared=False, size=path.stat().st_size, dtype=torch.uint8)
            self._mapped[fname] = whole
        data = whole[8 + header_len + begin: 8 + header_len + end]
        return data.view(self.dtype(name)).view(tuple(meta["shape"]))

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

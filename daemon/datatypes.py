"""Tensor datatypes: KServe v2 wire names, numpy dtypes and torch dtypes in one table."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class DataType:
    name: str  # the wire name, e.g. "FP32"
    numpy: np.dtype
    torch: torch.dtype

    @property
    def itemsize(self) -> int:
        return self.numpy.itemsize


_TABLE = [
    DataType("BOOL", np.dtype(np.bool_), torch.bool),
    DataType("UINT8", np.dtype(np.uint8), torch.uint8),
    DataType("INT8", np.dtype(np.int8), torch.int8),
    DataType("INT16", np.dtype(np.int16), torch.int16),
    DataType("INT32", np.dtype(np.int32), torch.int32),
    DataType("INT64", np.dtype(np.int64), torch.int64),
    DataType("FP16", np.dtype(np.float16), torch.float16),
    DataType("FP32", np.dtype(np.float32), torch.float32),
    DataType("FP64", np.dtype(np.float64), torch.float64),
]
# Wire data is little-endian whatever the host; numpy arrays built from it use these dtypes.
BY_NAME: dict[str, DataType] = {d.name: d for d in _TABLE}
BY_NUMPY: dict[np.dtype, DataType] = {d.numpy: d for d in _TABLE}
BY_TORCH: dict[torch.dtype, DataType] = {d.torch: d for d in _TABLE}

# Names that KServe defines but no torch model here can take or give.
KNOWN_UNSUPPORTED = frozenset({"UINT16", "UINT32", "UINT64", "BF16", "BYTES"})


def lookup(name: str) -> DataType | None:
    return BY_NAME.get(name)

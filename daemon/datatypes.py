"""Tensor datatypes: KServe v2 wire names, numpy dtypes and torch dtypes in one table.

Two need more than numpy alone: BF16 is `ml_dtypes.bfloat16` (numpy has no bfloat16; torch's
is `torch.bfloat16`), and BYTES (variable-length strings) is a numpy object array of `bytes`,
sent on the wire as 4-byte little-endian lengths each followed by its bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import torch
from torch import dtype as TorchDtype  # (inside DataType, `torch` names its field)


@dataclass(frozen=True, slots=True)
class DataType:
    name: str  # the wire name, e.g. "FP32"
    numpy: np.dtype
    torch: torch.dtype | None  # None: no torch tensor holds it (BYTES)

    @property
    def itemsize(self) -> int:
        """Bytes per element on the wire; 0 for BYTES, whose elements vary."""
        return 0 if self.variable else self.numpy.itemsize

    @property
    def variable(self) -> bool:
        return self.name == "BYTES"

    @property
    def tensor_dtype(self) -> TorchDtype:
        """The torch dtype of a model tensor of this type (BYTES never reaches a model: it has none)."""
        if self.torch is None:
            raise ValueError(f"{self.name} has no torch dtype: it is a wire-only type")
        return self.torch


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
    DataType("BF16", np.dtype(ml_dtypes.bfloat16), torch.bfloat16),
    DataType("BYTES", np.dtype(object), None),
]
# Wire data is little-endian whatever the host; numpy arrays built from it use these dtypes.
BY_NAME: dict[str, DataType] = {d.name: d for d in _TABLE}
BY_NUMPY: dict[np.dtype, DataType] = {d.numpy: d for d in _TABLE}
BY_TORCH: dict[torch.dtype, DataType] = {d.torch: d for d in _TABLE if d.torch is not None}

# Names that KServe defines but no torch model here can take or give.
KNOWN_UNSUPPORTED = frozenset({"UINT16", "UINT32", "UINT64"})
# Datatypes every frontend decodes, checks and encodes, but that a model's config cannot use yet:
# the runtime's IO buffers are numpy views of torch tensors, which bfloat16 and strings are not.
WIRE_ONLY = frozenset({"BF16", "BYTES"})


def lookup(name: str) -> DataType | None:
    return BY_NAME.get(name)

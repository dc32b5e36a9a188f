"""Tensor datatypes: KServe v2 wire names, numpy dtypes and torch dtypes in one table.

Two need more than numpy alone: BF16 is `ml_dtypes.bfloat16` (numpy has no bfloat16; torch's
is `torch.bfloat16`), and BYTES (variable-length strings) is a numpy object array of `bytes`,
sent on the wire as 4-byte little-endian lengths each followed by its bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

if TYPE_CHECKING:
    import torch
    from torch import dtype as TorchDtype  # (inside DataType, `torch` names a property)

# torch is imported on first need, not here: frontend worker processes decode and encode tensors
# with numpy alone and never load torch (hundreds of MiB and seconds of start-up each).
_TORCH: dict[str, torch.dtype] = {}


def _torch_dtype(name: str) -> torch.dtype:
    dt = _TORCH.get(name)
    if dt is None:
        import torch

        dt = _TORCH[name] = getattr(torch, name)
    return dt


@dataclass(frozen=True, slots=True)
class DataType:
    name: str  # the wire name, e.g. "FP32"
    numpy: np.dtype
    torch_name: str | None  # the torch dtype's attribute name; None: no torch tensor holds it (BYTES)

    @property
    def torch(self) -> TorchDtype | None:
        return None if self.torch_name is None else _torch_dtype(self.torch_name)

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
        if self.torch_name is None:
            raise ValueError(f"{self.name} has no torch dtype: it is a wire-only type")
        return _torch_dtype(self.torch_name)


_TABLE = [
    DataType("BOOL", np.dtype(np.bool_), "bool"),
    DataType("UINT8", np.dtype(np.uint8), "uint8"),
    DataType("INT8", np.dtype(np.int8), "int8"),
    DataType("INT16", np.dtype(np.int16), "int16"),
    DataType("INT32", np.dtype(np.int32), "int32"),
    DataType("INT64", np.dtype(np.int64), "int64"),
    DataType("FP16", np.dtype(np.float16), "float16"),
    DataType("FP32", np.dtype(np.float32), "float32"),
    DataType("FP64", np.dtype(np.float64), "float64"),
    DataType("BF16", np.dtype(ml_dtypes.bfloat16), "bfloat16"),
    DataType("BYTES", np.dtype(object), None),
]
# Wire data is little-endian whatever the host; numpy arrays built from it use these dtypes.
BY_NAME: dict[str, DataType] = {d.name: d for d in _TABLE}
BY_NUMPY: dict[np.dtype, DataType] = {d.numpy: d for d in _TABLE}


def __getattr__(name: str) -> Any:
    # BY_TORCH: dict[torch.dtype, DataType], made (importing torch) on first use
    if name == "BY_TORCH":
        table = {d.tensor_dtype: d for d in _TABLE if d.torch_name is not None}
        globals()["BY_TORCH"] = table
        return table
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Names that KServe defines but no torch model here can take or give.
KNOWN_UNSUPPORTED = frozenset({"UINT16", "UINT32", "UINT64"})
# Datatypes every frontend decodes, checks and encodes, but that a model's config cannot use yet:
# the runtime's IO buffers are numpy views of torch tensors, which bfloat16 and strings are not.
WIRE_ONLY = frozenset({"BF16", "BYTES"})


def lookup(name: str) -> DataType | None:
    return BY_NAME.get(name)

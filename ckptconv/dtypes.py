"""The one dtype table: safetensors code <-> numpy/ml_dtypes <-> torch names <-> item size.

Every reader and writer looks dtypes up here, so a dtype is supported everywhere or nowhere.
"""
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .errors import BadInput


@dataclass(frozen=True)
class DType:
    code: str            # safetensors header code: "BF16"
    numpy: np.dtype      # little-endian numpy (or ml_dtypes) dtype
    torch: str           # torch dtype attribute name: "bfloat16"
    storage: str | None  # legacy typed-storage class name: "BFloat16Storage"

    @property
    def itemsize(self) -> int:
        return self.numpy.itemsize

    @property
    def is_float(self) -> bool:
        return self.code.startswith(("F", "BF"))


def _dt(code, np_dtype, torch_name, storage):
    return DType(code, np.dtype(np_dtype).newbyteorder("<") if np.dtype(np_dtype).itemsize > 1 else np.dtype(np_dtype),
                 torch_name, storage)


DTYPES = [
    _dt("F64", np.float64, "float64", "DoubleStorage"),
    _dt("F32", np.float32, "float32", "FloatStorage"),
    _dt("F16", np.float16, "float16", "HalfStorage"),
    _dt("BF16", ml_dtypes.bfloat16, "bfloat16", "BFloat16Storage"),
    _dt("I64", np.int64, "int64", "LongStorage"),
    _dt("I32", np.int32, "int32", "IntStorage"),
    _dt("I16", np.int16, "int16", "ShortStorage"),
    _dt("I8", np.int8, "int8", "CharStorage"),
    _dt("U64", np.uint64, "uint64", None),
    _dt("U32", np.uint32, "uint32", None),
    _dt("U16", np.uint16, "uint16", None),
    _dt("U8", np.uint8, "uint8", "ByteStorage"),
    _dt("BOOL", np.bool_, "bool", "BoolStorage"),
    _dt("F8_E4M3", ml_dtypes.float8_e4m3fn, "float8_e4m3fn", None),
    _dt("F8_E5M2", ml_dtypes.float8_e5m2, "float8_e5m2", None),
]

BY_CODE = {d.code: d for d in DTYPES}
BY_TORCH = {d.torch: d for d in DTYPES}
BY_STORAGE = {d.storage: d for d in DTYPES if d.storage}
# torch dtypes that exist but that safetensors cannot store: named in errors, skippable.
TORCH_UNSUPPORTED = {
    "complex32", "complex64", "complex128", "cfloat", "cdouble", "qint8", "quint8", "qint32",
    "quint4x2", "quint2x4", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2",
    "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2", "int1", "int2", "int3", "int4", "int5", "int6", "int7",
    "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7",
}
# Typed-storage classes of such dtypes: class name -> (dtype name, bytes per element).
TORCH_UNSUPPORTED_STORAGES = {
    "ComplexFloatStorage": ("complex64", 8), "ComplexDoubleStorage": ("complex128", 16),
    "QInt8Storage": ("qint8", 1), "QUInt8Storage": ("quint8", 1), "QInt32Storage": ("qint32", 4),
    "QUInt4x2Storage": ("quint4x2", 1), "QUInt2x4Storage": ("quint2x4", 1),
}
# Aliases torch also accepts as attribute names.
BY_TORCH.update({"float": BY_TORCH["float32"], "double": BY_TORCH["float64"], "half": BY_TORCH["float16"],
                 "long": BY_TORCH["int64"], "int": BY_TORCH["int32"], "short": BY_TORCH["int16"]})


def from_code(code: str) -> DType:
    try:
        return BY_CODE[code]
    except KeyError:
        raise BadInput(f"unknown safetensors dtype {code!r}") from None


def from_numpy(dtype) -> DType:
    """Map any numpy dtype (either byte order) to the table; unknown kinds are refused."""
    dtype = np.dtype(dtype)
    native = dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype
    for d in DTYPES:
        if d.numpy == native:
            return d
    raise BadInput(f"dtype {dtype.str!r} ({dtype.name}) cannot be stored in safetensors")


# `--dtype` targets for casting floating tensors.
CAST_TARGETS = {"bf16": BY_CODE["BF16"], "f16": BY_CODE["F16"], "f32": BY_CODE["F32"]}

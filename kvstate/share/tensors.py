"""Engine tensors as the op engine sees them: an address, a dtype, a shape and strides.

:func:`adapt` accepts, in this order of preference:

=============  ==========================================================================
torch tensor   ``data_ptr()``, ``shape``, ``stride()``, ``dtype``, ``device``; strided
               layout only (no sparse, quantized, conjugate or negative views). torch is
               never imported: a tensor is recognised by its class.
numpy array    ``__array_interface__`` (address, read-only flag, byte strides); numpy
               has no bfloat16 or FP8, so ``uint16``/``uint8`` arrays (or ml_dtypes'
               ``bfloat16``/``float8_*``) stand for them.
DLPack         ``__dlpack_device__`` first (memory this process cannot touch is refused
               before anything is exported), then ``__dlpack__`` (version 1 when the
               producer speaks it: it carries a read-only flag). The capsule is kept,
               unconsumed, until the transfer ends; dropping it runs the producer's deleter.
buffer         the buffer protocol (bytearray, memoryview, mmap, array.array): C-contiguous
               only, exported with ``ffi.from_buffer`` and released explicitly.
=============  ==========================================================================

An unsigned integer type of the region's item size is accepted as raw bits for any
region dtype, since numpy and the buffer protocol have no bfloat16 or FP8 types.

Every :class:`TensorRef` that :func:`adapt` returns holds whatever keeps the memory alive
(the object, the capsule, the buffer export) until :meth:`TensorRef.release`, which the
load and store paths call on every path, success or failure.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import attrs

from kvstate.core import blockmap
from kvstate.core.errors import ArgumentInvalid, ConfigInvalid
from kvstate.core.geometry import Region, contiguous_strides
from kvstate.core.reasons import ArgumentReason, ConfigReason
from kvstate.transport.native import RawBuffer

_TORCH_DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32",
                 "torch.float8_e4m3fn": "fp8_e4m3", "torch.float8_e5m2": "fp8_e5m2", "torch.uint8": "u8",
                 "torch.uint16": "u16", "torch.uint32": "u32", "torch.uint64": "u64", "torch.int8": "i8",
                 "torch.int16": "i16", "torch.int32": "i32", "torch.int64": "i64", "torch.float64": "fp64"}
_NUMPY_NAMES = {"bfloat16": "bf16", "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}
_FORMATS = {"e": "fp16", "f": "fp32", "d": "fp64", "B": "u8", "H": "u16", "I": "u32", "L": "u64", "Q": "u64",
            "b": "i8", "h": "i16", "i": "i32", "l": "i64", "q": "i64", "c": "u8"}
#: DLPack (code, bits) -> dtype; codes from dlpack.h: 0 int, 1 uint, 2 float, 4 bfloat,
#: 10 float8_e4m3fn, 12 float8_e5m2.
_DLPACK_DTYPES = {(2, 16): "fp16", (2, 32): "fp32", (2, 64): "fp64", (4, 16): "bf16", (10, 8): "fp8_e4m3",
                  (12, 8): "fp8_e5m2", **{(1, b): f"u{b}" for b in (8, 16, 32, 64)},
                  **{(0, b): f"i{b}" for b in (8, 16, 32, 64)}}
_DLPACK_HOST = {1: "cpu", 3: "cpu"}  # kDLCPU, kDLCUDAHost (pinned host memory)
_DLPACK_READ_ONLY = 1


@attrs.define(eq=False)
class TensorRef:
    """One adapted tensor. ``strides`` are in elements; ``addr`` is element [0, ..., 0]."""

    kind: str
    addr: int
    dtype: str
    itemsize: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    device: str
    writable: bool
    owner: Any
    export: Any = None  # a cffi buffer export, given back by release()

    @property
    def span(self) -> int:
        return blockmap.span(self.itemsize, self.shape, self.strides) if all(self.shape) else 0

    def buffer(self) -> RawBuffer:
        return RawBuffer(self.addr, self.span, self)

    def release(self) -> None:
        """Give back the export and let go of the memory (idempotent)."""
        export, self.export, self.owner = self.export, None, None
        if export is not None:
            _ffi().release(export)


def _ffi() -> Any:
    from kvstate.transport.native import default
    return default().ffi


def _reject(reason: ArgumentReason, where: str, detail: str) -> ArgumentInvalid:
    return ArgumentInvalid.transfer(reason, where, detail)


def adapt(obj: Any, where: str) -> TensorRef:
    """The TensorRef of ``obj`` (see the module docstring), or ArgumentInvalid.transfer(TENSOR)."""
    if _is_torch(obj):
        return _torch(obj, where)
    ai = getattr(type(obj), "__array_interface__", None)
    if ai is not None and isinstance(getattr(obj, "__array_interface__", None), dict):
        ref = _array_interface(obj, where)
        if ref is not None:
            return ref
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        return _dlpack(obj, where)
    return _buffer(obj, where)


# -- torch --------------------------------------------------------------------------------


def _is_torch(obj: Any) -> bool:
    return any(c.__name__ == "Tensor" and c.__module__ == "torch" for c in type(obj).__mro__)


def _torch(t: Any, where: str) -> TensorRef:
    layout, dtype, device = str(t.layout), str(t.dtype), str(t.device)
    if layout != "torch.strided":
        raise _reject(ArgumentReason.TENSOR, where, f"a {layout} tensor; only strided (dense) tensors hold pages")
    if t.is_conj() or t.is_neg():
        raise _reject(ArgumentReason.TENSOR, where, "a lazily conjugated or negated view; resolve it first")
    if device == "meta":
        raise _reject(ArgumentReason.DEVICE, where, "a meta tensor has no memory")
    return TensorRef("torch", int(t.data_ptr()), _TORCH_DTYPES.get(dtype, f"other:{dtype}"), int(t.element_size()),
                     tuple(int(n) for n in t.shape), tuple(int(s) for s in t.stride()), device, True, t)


# -- numpy and other __array_interface__ exporters -----------------------------------------


def _array_interface(a: Any, where: str) -> TensorRef | None:
    ai = a.__array_interface__
    data = ai.get("data")
    if not isinstance(data, tuple):
        return None  # described through the buffer protocol instead
    if ai.get("mask") is not None:
        raise _reject(ArgumentReason.TENSOR, where, "a masked array")
    typestr = str(ai.get("typestr", ""))
    if len(typestr) < 3 or typestr[0] == ">":
        raise _reject(ArgumentReason.DTYPE, where, f"element type {typestr!r} is not native-endian")
    kind, digits = typestr[1], typestr[2:]
    if not digits.isdigit():  # e.g. datetime64's '<M8[ns]': not plain numbers
        raise _reject(ArgumentReason.DTYPE, where, f"element type {typestr!r} is not a number kvstate copies")
    size = int(digits)
    name = str(getattr(getattr(a, "dtype", None), "name", ""))
    dtype = (_NUMPY_NAMES.get(name) or {"f": f"fp{8 * size}", "u": f"u{8 * size}", "i": f"i{8 * size}"}.get(kind)
             or f"other:{typestr}")
    shape = tuple(int(n) for n in ai["shape"])
    raw = ai.get("strides")
    if raw is None:
        strides = contiguous_strides(shape)
    else:
        if any(int(s) % size for s in raw):
            raise _reject(ArgumentReason.STRIDES, where, f"byte strides {tuple(raw)} are not multiples of the "
                          f"item size {size}")
        strides = tuple(int(s) // size for s in raw)
    return TensorRef("numpy", int(data[0]), dtype, size, shape, strides, "cpu", not bool(data[1]), a)


# -- DLPack ---------------------------------------------------------------------------------


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int32), ("dtype", _DataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _ManagedVersioned(ctypes.Structure):
    _fields_ = [("version", _Version), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype = ctypes.c_char_p
_capsule_name.argtypes = [ctypes.py_object]
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_MAX_NDIM = 16


def _dlpack(obj: Any, where: str) -> TensorRef:
    try:
        dev_type, dev_id = obj.__dlpack_device__()
        device = _DLPACK_HOST.get(int(dev_type), f"dlpack:{int(dev_type)}:{int(dev_id)}")
    except Exception as exc:  # a foreign producer's failure, reported as ours
        raise _reject(ArgumentReason.TENSOR, where, f"__dlpack_device__ failed: {exc!r:.120}") from None
    if device != "cpu":
        raise _reject(ArgumentReason.DEVICE, where, f"DLPack device {device}: this transport reaches host memory only")
    try:
        try:
            capsule = obj.__dlpack__(max_version=(1, 0))
        except TypeError:  # a producer of the pre-1.0 protocol
            capsule = obj.__dlpack__()
        name = _capsule_name(capsule)
        ptr = _capsule_pointer(capsule, name)
    except Exception as exc:
        raise _reject(ArgumentReason.TENSOR, where, f"__dlpack__ failed: {exc!r:.120}") from None
    writable = True  # the pre-1.0 protocol cannot say; producers then refuse read-only arrays themselves
    if name == b"dltensor_versioned":
        managed = _ManagedVersioned.from_address(ptr)
        if managed.version.major != 1:
            raise _reject(ArgumentReason.TENSOR, where, f"DLPack version {managed.version.major} is not 1")
        dl, writable = managed.dl_tensor, not managed.flags & _DLPACK_READ_ONLY
    elif name == b"dltensor":
        dl = _DLTensor.from_address(ptr)
    else:
        raise _reject(ArgumentReason.TENSOR, where, f"capsule named {name!r:.40} is not a DLPack tensor")
    if not 0 <= dl.ndim <= _MAX_NDIM or dl.dtype.lanes != 1 or not dl.data:
        raise _reject(ArgumentReason.TENSOR, where, f"DLPack tensor of {dl.ndim} dims, {dl.dtype.lanes} lanes")
    shape = tuple(int(dl.shape[i]) for i in range(dl.ndim))
    strides = tuple(int(dl.strides[i]) for i in range(dl.ndim)) if dl.strides else contiguous_strides(shape)
    bits = int(dl.dtype.bits)
    dtype = _DLPACK_DTYPES.get((int(dl.dtype.code), bits), f"other:dlpack{dl.dtype.code}/{bits}")
    if bits % 8:
        raise _reject(ArgumentReason.DTYPE, where, f"{bits}-bit elements are not byte-addressable")
    return TensorRef("dlpack", int(dl.data) + int(dl.byte_offset), dtype, bits // 8, shape, strides, device,
                     writable, (obj, capsule))


# -- the buffer protocol ------------------------------------------------------------------


def _buffer(obj: Any, where: str) -> TensorRef:
    try:
        mv = memoryview(obj)
    except TypeError:
        raise _reject(ArgumentReason.TENSOR, where, f"a {type(obj).__name__} is not a tensor, array, DLPack "
                      "object or buffer") from None
    except ValueError as exc:  # a closed mmap, a released memoryview: no memory to copy
        raise _reject(ArgumentReason.TENSOR, where, f"a {type(obj).__name__} whose buffer is gone ({exc})") from None
    with mv:
        fmt = mv.format.lstrip("@=<")
        dtype = _FORMATS.get(fmt, f"other:{mv.format}")
        if not mv.c_contiguous:
            raise _reject(ArgumentReason.STRIDES, where, "a strided buffer; pass a numpy array or a tensor instead")
        shape, itemsize, readonly = tuple(mv.shape or ()), mv.itemsize, mv.readonly
    try:
        export = _ffi().from_buffer(obj, require_writable=False)
    except (TypeError, BufferError) as exc:
        raise _reject(ArgumentReason.TENSOR, where, f"not a usable buffer: {exc}") from None
    addr = int(_ffi().cast("uintptr_t", export))
    return TensorRef("buffer", addr, dtype, itemsize, shape, contiguous_strides(shape), "cpu", not readonly, obj,
                     export)


# -- a tensor against a region --------------------------------------------------------------


def accepts(region: Region, ref: TensorRef) -> bool:
    """The tensor's element type is the region's, or unsigned raw bits of its width."""
    return ref.dtype == region.dtype.value or (ref.dtype == f"u{8 * region.itemsize}"
                                               and ref.itemsize == region.itemsize)


def check(region: Region, ref: TensorRef, where: str, *, write: bool) -> None:
    """Refuse ``ref`` as a source (``write=False``) or destination of ``region``'s blocks,
    naming the first field that differs. Its capacity (the size along the block dimension)
    may differ from the region's."""
    if ref.device != "cpu":
        raise _reject(ArgumentReason.DEVICE, where, f"on {ref.device}; this transport reaches host memory only")
    if not accepts(region, ref):
        raise _reject(ArgumentReason.DTYPE, where, f"dtype {ref.dtype}, region {region.name!r} holds "
                      f"{region.dtype.value}")
    if len(ref.shape) != len(region.shape):
        raise _reject(ArgumentReason.SHAPE, where, f"{len(ref.shape)} dimensions {ref.shape}, region has "
                      f"{len(region.shape)} {region.shape}")
    for i, (a, b) in enumerate(zip(ref.shape, region.shape)):
        if i != region.block_dim and a != b:
            raise _reject(ArgumentReason.SHAPE, where, f"dimension {i} is {a}, region {region.name!r} has {b} "
                          f"(shape {ref.shape} vs {region.shape}, blocks along dimension {region.block_dim})")
    if ref.shape[region.block_dim] < 1:
        raise _reject(ArgumentReason.SHAPE, where, "holds no blocks")
    if any(s < 0 for s in ref.strides) or not blockmap.non_overlapping(ref.shape, ref.strides):
        raise _reject(ArgumentReason.STRIDES, where, f"strides {ref.strides} are negative or make elements overlap")
    if write and not ref.writable:
        raise _reject(ArgumentReason.READ_ONLY, where, "is read-only")
    if math.prod(ref.shape) * ref.itemsize > 1 << 56:
        raise _reject(ArgumentReason.SHAPE, where, "larger than 2**56 bytes")


def runs(ref: TensorRef, block_dim: int, where: str) -> blockmap.Runs:
    try:
        return blockmap.block_runs(ref.itemsize, ref.shape, ref.strides, block_dim)
    except ConfigInvalid as exc:
        if exc.reason is not ConfigReason.GEOMETRY:
            raise
        raise _reject(ArgumentReason.STRIDES, where, exc.problem or exc.detail) from None


def release_all(refs: list[TensorRef]) -> None:
    for r in refs:
        r.release()

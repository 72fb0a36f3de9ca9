"""Adapters from tensors users already have to the block layouts kernels.dsl declares.

GGUF blocks need none: an array of Q8_0/Q4_0/Q4_K/... blocks is already `(rows, n_blocks)` of the
declared dtype, and `load_gguf` packs every tensor of a .gguf file (read by the `gguf` package,
llama.cpp's own reader) whose type the build declares. ONNX keeps a 4-bit MatMul weight as three tensors (values, scales, zero points),
each laid out along K of B[K, N]; `onnx_uint4_blocks` gathers them into q4_onnx blocks per output
row. Unpacking, packing and kernels then come from the declaration like any other type.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..quantformat import QuantFormat

if TYPE_CHECKING:
    from .api import Kernels, Packed

GGUF_FLOATS = ("F32", "F16")  # returned as numpy arrays


def load_gguf(kernels: Kernels, path: str | Path) -> dict[str, Packed | np.ndarray]:
    """Every tensor of a .gguf file by name: quantized ones packed into `kernels`' memory (a GGUF
    type is supported when the build declares a quant type of its name in lower case: Q4_K ->
    q4_k), F32/F16 ones as numpy arrays in numpy's axis order. A tensor of another type raises
    ValueError naming it, its type and the supported types, before anything is packed; if packing
    fails part way, what was packed is freed (nothing is half-loaded)."""
    try:
        import gguf
    except ImportError:
        raise ImportError("load_gguf reads files with the gguf package: pip install 'kernelgen[gguf]'") from None
    reader = gguf.GGUFReader(path)
    supported = [*GGUF_FLOATS, *(t.name for t in gguf.GGMLQuantizationType if t.name.lower() in kernels.quants)]
    for t in reader.tensors:
        if t.tensor_type.name not in supported:
            raise ValueError(f"{path}: tensor {t.name!r} has type {t.tensor_type.name}, which this build does not "
                             f"support (supported: {', '.join(supported)})")
    out: dict[str, Packed | np.ndarray] = {}
    try:
        for t in reader.tensors:
            if t.tensor_type.name in GGUF_FLOATS:
                out[t.name] = np.array(t.data)
                continue
            # the reader's byte shape ends in a row's bytes (ggml's first dimension is the row)
            out[t.name] = kernels.pack(t.tensor_type.name.lower(), np.asarray(t.data).reshape(-1, t.data.shape[-1]))
    except BaseException:
        for v in out.values():
            if not isinstance(v, np.ndarray):  # a Packed
                v.free()
        raise
    return out


def onnx_uint4_blocks(q4_onnx: QuantFormat, packed: np.ndarray, scale: np.ndarray, zero_point: np.ndarray,
                      k: int, n: int) -> np.ndarray:
    """B's UINT4 values (packed, element 2i in the low nibble, row-major [k, n]), scales [k/32, n]
    and packed UINT4 zero points [k/32, n] -> blocks (n, k / 32) of `q4_onnx`: one row per output."""
    block = q4_onnx.block
    if k % block or scale.shape != (k // block, n):
        raise ValueError(f"onnx_uint4_blocks: k={k} must be a multiple of {block} and scale of shape"
                         f" {(k // block, n)}, got {scale.shape}")
    if packed.size * 2 < k * n or zero_point.size * 2 < scale.size:
        raise ValueError("onnx_uint4_blocks: packed values or zero points are too short")
    q = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(-1)[:k * n].reshape(k, n)
    zp = np.stack([zero_point & 0x0F, zero_point >> 4], axis=-1).reshape(-1)[:scale.size].reshape(scale.shape)
    rows = q.T.reshape(n, k // block, block)  # output row, block, element
    out = np.zeros((n, k // block), q4_onnx.dtype)
    out["d"] = scale.T
    out["z"] = zp.T
    out["qs"] = (rows[..., 0::2] | (rows[..., 1::2] << 4)).astype(np.uint8)
    return out

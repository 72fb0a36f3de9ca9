"""Adapters from tensors users already have to the block layouts kernels.dsl declares.

GGUF blocks need none: an array of Q8_0/Q4_0/Q4_1 blocks is already `(rows, n_blocks)` of the
declared dtype. ONNX keeps a 4-bit MatMul weight as three tensors (values, scales, zero points),
each laid out along K of B[K, N]; `onnx_uint4_blocks` gathers them into q4_onnx blocks per output
row. Unpacking, packing and kernels then come from the declaration like any other type.
"""
from __future__ import annotations

import numpy as np

from ..quantformat import QuantFormat


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

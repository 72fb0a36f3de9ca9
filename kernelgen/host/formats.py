"""Adapters from tensors users already have to the block layouts kernels.dsl declares.

GGUF blocks need none: an array of Q8_0/Q4_0/Q4_K/... blocks is already `(rows, n_blocks)` of the
declared dtype, and `load_gguf` packs every tensor of a .gguf file (read by the `gguf` package,
llama.cpp's own reader) whose type the build declares. ONNX stores a 4-bit MatMul weight in one of
two representations, each with its own adapter here, named for it and taking the node's tensors and
attributes as onnxruntime writes them:

- `matmul_nbits_blocks`: com.microsoft `MatMulNBits` (what onnxruntime's MatMulNBitsQuantizer
  writes by default): B uint8 [N, n_blocks, block_size / 2], scales [N, n_blocks], zero_points uint8
  [N, ceil(n_blocks / 2)], attributes K, N, bits, block_size.
- `dequantize_linear_blocks`: a blocked `DequantizeLinear` feeding MatMul's B (the QDQ format):
  x UINT4/INT4 [K, N], x_scale [ceil(K / block_size), N], x_zero_point like x_scale, attributes
  axis = 0 and block_size.

Both return the `q4_onnx` blocks of the weight, one row per output (N, K / 32): y = blocks @ a.
Every tensor's shape is checked against the attributes, so that no layout is taken for the other
(a MatMulNBits B with N = K / 32 has the same element count as a [K, N] tensor); a wrong tensor is a
ValueError naming it, its shape and the shape expected. Quantization blocks longer than 32 (a
multiple of it) become several q4_onnx blocks with the same scale and zero point, which is exact.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..quantformat import QuantFormat
from .module import I32_MAX, as_int

if TYPE_CHECKING:
    from .api import Kernels, Packed

MAX_DIMS = 4  # GGML_MAX_DIMS
GGUF_FLOATS = ("F32", "F16", "BF16")  # returned as numpy arrays (BF16 widened to float32: numpy has no bfloat16)


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ImportError("reading a .gguf file needs the gguf package: pip install 'kernelgen[gguf]'") from None
    return gguf


def _checked_tensors(path: str | Path, declared: list[str] | dict) -> list:
    """The tensors of a .gguf file, after checking that every one is F32, F16, BF16 or a type of `declared`
    (quant type names: a GGUF type is one when its name in lower case is declared, Q4_K -> q4_k); a
    ValueError names the first that is not, its type and the supported types (or the file, when it is
    not GGUF)."""
    gguf = _gguf()
    try:
        reader = gguf.GGUFReader(path)
    except OSError:
        raise
    except Exception as e:  # the reader's own on a file that is not GGUF: ValueError, struct.error, ...
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    supported = [*GGUF_FLOATS, *(t.name for t in gguf.GGMLQuantizationType if t.name.lower() in declared)]
    for t in reader.tensors:
        if t.tensor_type.name not in supported:
            raise ValueError(f"{path}: tensor {t.name!r} has type {t.tensor_type.name}, which this build does not "
                             f"support (supported: {', '.join(supported)})")
    # What llama.cpp refuses and the reader takes (a 5-D tensor read as 2-D, one tensor's bytes
    # inside another's): refused here as by the JS runtime's reader (runtime/gguf.mjs), file for file.
    for t in reader.tensors:
        dims = [int(d) for d in t.shape]
        if not 1 <= len(dims) <= MAX_DIMS or min(dims) < 1:
            raise ValueError(f"{path}: tensor {t.name!r} has dimensions {dims} (1 to {MAX_DIMS}, each at least 1)")
        if t.data_offset % reader.alignment:
            raise ValueError(f"{path}: tensor {t.name!r}'s data offset is not a multiple of the alignment {reader.alignment}")
    spans = sorted(reader.tensors, key=lambda t: t.data_offset)
    for a, b in zip(spans, spans[1:]):
        if a.data_offset + a.n_bytes > b.data_offset:
            raise ValueError(f"{path}: tensors {a.name!r} and {b.name!r} overlap")
    return reader.tensors


def gguf_quants(path: str | Path, declared: list[str] | dict) -> list[str]:
    """The quant types (of `declared`, in its order) that a .gguf file's tensors use: what a build
    for that model needs (`kernelgen build --quant-from FILE`). ValueError as load_gguf's."""
    used = {t.tensor_type.name.lower() for t in _checked_tensors(path, declared)}
    return [q for q in declared if q in used]


def load_gguf(kernels: Kernels, path: str | Path) -> dict[str, Packed | np.ndarray]:
    """Every tensor of a .gguf file by name: quantized ones packed into `kernels`' memory (a GGUF
    type is supported when the build declares a quant type of its name in lower case: Q4_K ->
    q4_k), F32/F16 ones as numpy arrays in numpy's axis order, BF16 ones as float32 (exactly). A
    tensor of another type raises ValueError naming it, its type and the supported types, before
    anything is packed, as does one llama.cpp refuses (more than 4 dimensions or a dimension of 0,
    bytes that overlap another's, an offset off the alignment); if packing fails part way, what was
    packed is freed (nothing is half-loaded)."""
    from .api import Kernels  # (api imports this module's callers, not this module)

    if not isinstance(kernels, Kernels):
        raise TypeError(f"load_gguf kernels: expected a Kernels from kernelgen.load(), got {type(kernels).__name__}")
    if not isinstance(path, (str, Path)):
        raise TypeError(f"load_gguf path: expected a path (str or Path), got {type(path).__name__}")
    tensors = _checked_tensors(path, kernels.quants)
    out: dict[str, Packed | np.ndarray] = {}
    try:
        for t in tensors:
            if t.tensor_type.name in GGUF_FLOATS:
                out[t.name] = _floats(t)
                continue
            # the reader's byte shape ends in a row's bytes (ggml's first dimension is the row)
            out[t.name] = kernels.pack(t.tensor_type.name.lower(), np.asarray(t.data).reshape(-1, t.data.shape[-1]))
    except BaseException:
        for v in out.values():
            if not isinstance(v, np.ndarray):  # a Packed
                v.free()
        raise
    return out


def _floats(t) -> np.ndarray:
    """A float tensor of the reader as a numpy array of its own, in numpy's axis order. The reader
    gives BF16 as its bytes (the row length doubled); a bfloat16 is the top half of a float32."""
    if t.tensor_type.name != "BF16":
        return np.array(t.data)
    halves = np.ascontiguousarray(t.data).view("<u2").astype(np.uint32)
    return (halves << 16).view(np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))


def _check(op: str, name: str, a: np.ndarray, shapes: list[tuple[int, ...]], attrs: str,
           dtypes: tuple[str, ...]) -> np.ndarray:
    """`a` as a numpy array of one of `dtypes` and one of `shapes`, else a ValueError/TypeError naming it."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{op}: {name} must be a numpy array (onnx.numpy_helper.to_array), got {type(a).__name__}")
    if a.dtype.name not in dtypes:
        raise TypeError(f"{op}: {name} has dtype {a.dtype.name}, expected {' or '.join(dtypes)}")
    if a.shape not in shapes:
        expected = " or ".join(str(list(s)) for s in shapes)
        raise ValueError(f"{op}: {name} has shape {list(a.shape)}, expected {expected} ({attrs})")
    return a


def _blocks(op: str, q4_onnx: QuantFormat, k: int, n: int, block_size: int) -> int:
    """Check the sizes the kernels can take; returns q4_onnx blocks per quantization block."""
    if not isinstance(q4_onnx, QuantFormat):
        raise TypeError(f"{op}: expected the q4_onnx quant type, k.quants['q4_onnx'] (a QuantFormat), got "
                        f"{type(q4_onnx).__name__}")
    k, n, block_size = (as_int(f"{op} {what}", v, -I32_MAX, I32_MAX)
                        for what, v in (("K", k), ("N", n), ("block_size", block_size)))
    if q4_onnx.block != 32 or [f.name for f in q4_onnx.fields] != ["d", "z", "qs"]:
        raise ValueError(f"{op}: expected the q4_onnx quant type (d: f32, z: u8, qs: u8[16], block 32)")
    if k <= 0 or n <= 0 or k % 32:
        raise ValueError(f"{op}: K={k} and N={n}: K must be a positive multiple of 32 (the kernels' activation"
                         f" block) and N positive")
    if block_size <= 0 or block_size % 32:
        raise ValueError(f"{op}: block_size={block_size}: the kernels take blocks of 32 or a multiple of 32")
    return block_size // 32


def _assemble(q4_onnx: QuantFormat, values: np.ndarray, scale: np.ndarray, zero: np.ndarray, per: int,
              k: int) -> np.ndarray:
    """values uint8 [N, K] (0..15), scale and zero [N, n_blocks] -> q4_onnx blocks (N, K / 32)."""
    n = values.shape[0]
    out = np.zeros((n, k // 32), q4_onnx.dtype)
    out["d"] = np.repeat(scale.astype(np.float32), per, axis=1)[:, :k // 32]
    out["z"] = np.repeat(zero, per, axis=1)[:, :k // 32]
    v = values.reshape(n, k // 32, 32)
    out["qs"] = v[..., 0::2] | (v[..., 1::2] << 4)  # element 2i in the low nibble of byte i
    return out


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., m] -> uint8 [..., 2m]: the low nibble first."""
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[:-1] + (-1,))


def matmul_nbits_blocks(q4_onnx: QuantFormat, B: np.ndarray, scales: np.ndarray,
                        zero_points: np.ndarray | None = None, *, K: int, N: int, bits: int,
                        block_size: int) -> np.ndarray:
    """A MatMulNBits node's B, scales and (optional) zero_points, with its attributes -> q4_onnx
    blocks (N, K / 32). Without zero_points the zero point is 8, as the operator defines."""
    op = "MatMulNBits"
    per = _blocks(op, q4_onnx, K, N, block_size)
    bits = as_int(f"{op} bits", bits, -I32_MAX, I32_MAX)
    if bits != 4:
        raise ValueError(f"{op}: bits={bits}: q4_onnx holds 4-bit values")
    nb = -(-K // block_size)
    attrs = f"K={K}, N={N}, bits={bits}, block_size={block_size}"
    B = _check(op, "B", B, [(N, nb, block_size // 2)], attrs, ("uint8",))
    scales = _check(op, "scales", scales, [(N, nb), (N * nb,)], attrs, ("float32", "float16")).reshape(N, nb)
    if zero_points is None:
        zero = np.full((N, nb), 8, np.uint8)
    else:
        zb = -(-nb // 2)
        zero_points = _check(op, "zero_points", zero_points, [(N, zb), (N * zb,)], attrs, ("uint8",))
        zero = _nibbles(zero_points.reshape(N, zb))[:, :nb]
    values = _nibbles(B.reshape(N, nb * block_size // 2))[:, :K]
    return _assemble(q4_onnx, values, scales, zero, per, K)


def dequantize_linear_blocks(q4_onnx: QuantFormat, x: np.ndarray, x_scale: np.ndarray,
                             x_zero_point: np.ndarray | None = None, *, axis: int, block_size: int) -> np.ndarray:
    """A blocked DequantizeLinear of MatMul's B: x [K, N] as onnx.numpy_helper.to_array returns a
    UINT4 or INT4 tensor (dtype uint4/int4), x_scale [ceil(K / block_size), N], x_zero_point of x's
    type and x_scale's shape (absent: 0), attributes axis (0: blocks along K) and block_size ->
    q4_onnx blocks (N, K / 32). INT4 values and zero points are shifted by 8 together (exact)."""
    op = "DequantizeLinear"
    if not isinstance(x, np.ndarray) or x.ndim != 2:
        raise ValueError(f"{op}: x must be MatMul's B, a 2-D [K, N] array, got "
                         f"{list(x.shape) if isinstance(x, np.ndarray) else type(x).__name__}")
    k, n = x.shape
    per = _blocks(op, q4_onnx, k, n, block_size)
    attrs = f"K={k}, N={n}, axis={axis}, block_size={block_size}"
    if axis != 0:
        raise ValueError(f"{op}: axis={axis}: the blocks must run along K, axis 0 of B [K, N] ({attrs})")
    nb = -(-k // block_size)
    x = _check(op, "x", x, [(k, n)], attrs, ("uint4", "int4"))
    x_scale = _check(op, "x_scale", x_scale, [(nb, n)], attrs, ("float32", "float16"))
    shift = 8 if x.dtype.name == "int4" else 0
    if x_zero_point is None:
        zero = np.full((nb, n), shift, np.uint8)
    else:
        x_zero_point = _check(op, "x_zero_point", x_zero_point, [(nb, n)], attrs, (x.dtype.name,))
        zero = (x_zero_point.astype(np.int16) + shift).astype(np.uint8)
    values = (x.astype(np.int16) + shift).astype(np.uint8)
    return _assemble(q4_onnx, np.ascontiguousarray(values.T), x_scale.T, zero.T, per, k)

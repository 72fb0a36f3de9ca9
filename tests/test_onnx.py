"""ONNX 4-bit weights as onnxruntime's own quantizer writes them (MatMulNBits, and blocked
DequantizeLinear in the QDQ format), through kernelgen.host.formats' adapters, against onnxruntime's
output on the same input: both targets, several K and N (N = K / 32 among them, K and N not powers
of two), block sizes 32 and 128, asymmetric and symmetric. A wrong tensor is refused by name."""
from __future__ import annotations

import logging
import re

import numpy as np
import pytest

import onnx  # noqa: F401  (test dependencies: pyproject.toml test extra)
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnxruntime.quantization import QuantFormat  # noqa: E402
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer  # noqa: E402

from kernelgen.host import formats  # noqa: E402

from helpers import rng_for  # noqa: E402

TARGETS = ("simd128", "relaxed-simd")
SHAPES = [(256, 8), (320, 10), (160, 7), (1024, 48)]  # (K, N): N = K / 32 twice, 320/10/160/7/48 not powers of two


def quantized_model(k: int, n: int, block: int, symmetric: bool, fmt: QuantFormat, seed: int):
    """A one-MatMul model Y = A @ W (W [K, N] normal, a few columns scaled up), quantized by onnxruntime."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((k, n)) * rng.uniform(0.2, 3, n)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["A", "W"], ["Y"])], "g",
                              [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, n])],
                              [numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
    q = MatMulNBitsQuantizer(model, block_size=block, is_symmetric=symmetric, quant_format=fmt)
    q.process()
    return q.model.model


def blocks_of(model, q4_onnx) -> np.ndarray:
    """The weight's q4_onnx blocks, from the node and initializers onnxruntime wrote."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    (node,) = [nd for nd in model.graph.node if nd.op_type in ("MatMulNBits", "DequantizeLinear")]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    tensors = [inits[name] for name in node.input if name in inits]
    if node.op_type == "MatMulNBits":
        return formats.matmul_nbits_blocks(q4_onnx, *tensors, K=attrs["K"], N=attrs["N"], bits=attrs["bits"],
                                           block_size=attrs["block_size"])
    return formats.dequantize_linear_blocks(q4_onnx, *tensors, axis=attrs["axis"], block_size=attrs["block_size"])


CASES = [(k, n, 32, False, QuantFormat.QOperator) for k, n in SHAPES] + [
    (256, 8, 32, False, QuantFormat.QDQ), (320, 10, 32, True, QuantFormat.QDQ), (160, 7, 32, False, QuantFormat.QDQ),
    (320, 10, 32, True, QuantFormat.QOperator), (1024, 48, 128, False, QuantFormat.QOperator),
    (640, 12, 128, False, QuantFormat.QDQ),  # 640 = 5 blocks of 128: the adapter splits each into 4
]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("k, n, block, symmetric, fmt", CASES,
                         ids=[f"{f.name}-K{k}-N{n}-b{b}-{'sym' if s else 'asym'}" for k, n, b, s, f in CASES])
def test_kernelgen_matches_onnxruntime(any_module, target, k, n, block, symmetric, fmt):
    km = any_module(target)
    q = km.quants["q4_onnx"]
    model = quantized_model(k, n, block, symmetric, fmt, seed=k + n)
    op = {QuantFormat.QOperator: "MatMulNBits", QuantFormat.QDQ: "DequantizeLinear"}[fmt]
    assert any(nd.op_type == op for nd in model.graph.node)
    blocks = blocks_of(model, q)
    assert blocks.shape == (n, k // 32)
    x = (rng_for("onnx-ort", k, n).standard_normal(k) * 2).astype(np.float32)
    options = ort.SessionOptions()
    # onnxruntime fuses DequantizeLinear + MatMul into MatMulNBits computing on int8 activations by
    # default (accuracy level 4); level 0 keeps float32 activations: the weights are what is compared.
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    y_ort = session.run(None, {"A": x[None]})[0][0].astype(np.float64)

    w = q.dequantize_ref(blocks).astype(np.float64)  # (N, K), as the adapter read it
    mag = np.abs(w) @ np.abs(x.astype(np.float64))
    # 1. The adapter read the weights onnxruntime computes with (a misread layout is off by O(1)).
    assert np.all(np.abs(y_ort - w @ x) <= 1e-5 * mag + 1e-6), np.abs(y_ort - w @ x).max()

    act = km.quantize_act(x)
    y = km.qmatvec(km.pack("q4_onnx", blocks), act).astype(np.float64)
    zero = km.manifest["constants"]["ACT_ZERO"]
    xq = (km.act_values(act).astype(np.float64) - zero) * np.repeat(act.d.astype(np.float64), 32)
    # 2. The kernel computes W @ dequantized activations, to float rounding.
    assert np.all(np.abs(y - w @ xq) <= 1e-5 * (np.abs(w) @ np.abs(xq)) + 1e-6)
    # 3. So it differs from onnxruntime by no more than the activation quantization error allows.
    bound = np.abs(w) @ np.abs(x - xq) + 2e-5 * mag + 1e-6
    assert np.all(np.abs(y - y_ort) <= bound), (np.abs(y - y_ort) / bound).max()
    assert np.abs(y - y_ort).max() < 0.05 * np.abs(y_ort).max()  # and that bound is tight enough to matter


@pytest.fixture(scope="module")
def nbits() -> dict:
    """The tensors of a MatMulNBits model with N = K / 32 (K=256, N=8), where a [K, N] layout has
    as many values as B."""
    model = quantized_model(256, 8, 32, False, QuantFormat.QOperator, seed=1)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    (node,) = model.graph.node
    return dict(zip(("B", "scales", "zero_points"), (inits[i] for i in node.input[1:])))


def test_matmul_nbits_refuses_each_wrong_tensor_by_name(quants4, nbits):
    q = quants4
    B, scales, zp = nbits["B"], nbits["scales"], nbits["zero_points"]
    attrs = dict(K=256, N=8, bits=4, block_size=32)
    fine = formats.matmul_nbits_blocks(q, B, scales, zp, **attrs)
    assert fine.shape == (8, 8)
    cases = [
        ((B.reshape(64, 16), scales, zp), attrs, "B has shape [64, 16], expected [8, 8, 16]"),
        ((B.reshape(256, 4), scales, zp), attrs, "B has shape [256, 4], expected [8, 8, 16]"),  # packed [K, N]
        ((B, scales[:, :4], zp), attrs, "scales has shape [8, 4], expected [8, 8] or [64]"),
        ((B, scales, zp[:, :3]), attrs, "zero_points has shape [8, 3], expected [8, 4] or [32]"),
        ((B, scales, zp), {**attrs, "K": 512}, "B has shape [8, 8, 16], expected [8, 16, 16] (K=512, N=8, bits=4, block_size=32)"),
        ((B, scales, zp), {**attrs, "N": 16}, "B has shape [8, 8, 16], expected [16, 8, 16]"),
        ((B, scales, zp), {**attrs, "bits": 8}, "bits=8: q4_onnx holds 4-bit values"),
        ((B, scales, zp), {**attrs, "block_size": 16}, "block_size=16: the kernels take blocks of 32"),
        ((B, scales, zp), {**attrs, "K": 100}, "K=100 and N=8: K must be a positive multiple of 32"),
    ]
    for args, kw, message in cases:
        with pytest.raises(ValueError, match=re.escape("MatMulNBits: " + message)):
            formats.matmul_nbits_blocks(q, *args, **kw)
    with pytest.raises(TypeError, match=re.escape("MatMulNBits: zero_points has dtype float32, expected uint8")):
        formats.matmul_nbits_blocks(q, B, scales, scales, **attrs)
    with pytest.raises(TypeError, match=re.escape("MatMulNBits: expected the q4_onnx quant type, k.quants['q4_onnx']")):
        formats.matmul_nbits_blocks("q4_onnx", B, scales, zp, **attrs)  # the name, where pack() takes one


def test_dequantize_linear_refuses_each_wrong_tensor_by_name(quants4, nbits):
    import ml_dtypes

    q = quants4
    values, scale, zp = (np.arange(256 * 8).reshape(256, 8) % 16).astype(ml_dtypes.uint4), \
        np.ones((8, 8), np.float32), np.full((8, 8), 8, ml_dtypes.uint4)
    fine = formats.dequantize_linear_blocks(q, values, scale, zp, axis=0, block_size=32)
    np.testing.assert_array_equal(q.dequantize_ref(fine), (values.astype(np.float32) - 8).T)
    with pytest.raises(ValueError, match=re.escape("DequantizeLinear: x must be MatMul's B, a 2-D [K, N] array, got [8, 8, 16]")):
        formats.dequantize_linear_blocks(q, nbits["B"], nbits["scales"], nbits["zero_points"], axis=0, block_size=32)
    with pytest.raises(TypeError, match=re.escape("DequantizeLinear: x has dtype uint8, expected uint4 or int4")):
        formats.dequantize_linear_blocks(q, values.astype(np.uint8), scale, zp, axis=0, block_size=32)
    with pytest.raises(ValueError, match=re.escape("DequantizeLinear: x_scale has shape [8, 4], expected [8, 8] (K=256, N=8, axis=0, block_size=32)")):
        formats.dequantize_linear_blocks(q, values, scale[:, :4], zp, axis=0, block_size=32)
    with pytest.raises(ValueError, match=re.escape("DequantizeLinear: x_zero_point has shape [4, 8], expected [8, 8]")):
        formats.dequantize_linear_blocks(q, values, scale, zp[:4], axis=0, block_size=32)
    with pytest.raises(ValueError, match=re.escape("DequantizeLinear: axis=1: the blocks must run along K")):
        formats.dequantize_linear_blocks(q, values, scale, zp, axis=1, block_size=32)
    with pytest.raises(TypeError, match=re.escape("x_zero_point has dtype int4, expected uint4")):
        formats.dequantize_linear_blocks(q, values, scale, np.zeros((8, 8), ml_dtypes.int4), axis=0,
                                         block_size=32)
    signed = (values.astype(np.int16) - 8).astype(ml_dtypes.int4)  # INT4, zero point 0: the same weights
    np.testing.assert_array_equal(formats.dequantize_linear_blocks(q, signed, scale, axis=0, block_size=32), fine)


@pytest.fixture
def quants4(module_cache):
    return module_cache.get("simd128").quants["q4_onnx"]

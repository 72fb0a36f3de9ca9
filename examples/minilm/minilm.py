"""all-MiniLM-L6-v2 sentence embeddings computed by kernelgen's kernels, linear layers in Q8_0 (or Q4_0).

    python examples/minilm/minilm.py [--target relaxed-simd] [--quant q8_0] [--threads 2] "a sentence" "another"

The same model runs in JS on kernelgen's runtime (minilm.mjs, call for call the same kernels, so the
same bits), from the tensors `prepare` makes here, written by export.py.

The host (this file) only moves data: it gathers embedding rows, lays out buffers and calls
kernels. Every arithmetic step runs in wasm:

    x = layernorm_f32(word[ids], residual=pos[0..T), bias=type[0])
    per layer:  qkv = qmatmul(Wqkv, quantize_act(x)) over all tokens, + bias   (linear: one call)
                ctx = attention_f32(qkv, lengths): per (sentence, head), scores, softmax and
                      the weighted values over the sentence's own tokens, in one call
                x = layernorm_f32(qmatmul(Wo, ctx), residual=x, bias=bo)
                x = layernorm_f32(qmatmul(W2, gelu_f32(qmatmul(W1, x), b1)), residual=x, bias=b2)
    embedding = l2_normalize_f32(mean_pool_f32(x padded to [batch, T, 384], mask))

The linear layers run as one qmatmul over all tokens of the batch (each row bit for bit the
per-token qmatvec, so the results did not change when they moved to it). Attention is one
attention_f32 call per layer for the whole batch: it reads each head's q, k and v where the QKV
projection left them (row stride 3 * 384) and gives one job per (sentence, head) to the pool. Only
the real tokens of each sentence are computed; the padding exists only in the pooling step, where
the mask keeps it out. `--quant q4_k_m` quantizes as llama.cpp's Q4_K_M would (q4_k_m): the K-quants'
super-blocks are 256 values and most of this model's rows 384, so most layers take the fallback types
Q5_0 and Q5_1, and only the FFN's down projection (rows of 1536) Q4_K and Q6_K.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import kernelgen
from kernelgen import reference
from kernelgen.host.api import Kernels, Packed
from kernelgen.host.pool import Pool

import inputs


@dataclass(frozen=True)
class Linear:
    """A linear layer y = W x + b with W packed in the module's memory."""

    w: Packed
    b: np.ndarray  # f32[out]


@dataclass(frozen=True)
class EncoderLayer:
    qkv: Linear    # queries (pre-scaled by 1 / sqrt(head size)), keys, values: [1152, 384]
    out: Linear    # attention output [384, 384]
    ln1: tuple[np.ndarray, np.ndarray]
    ffn1: Linear   # [1536, 384]
    ffn2: Linear   # [384, 1536]
    ln2: tuple[np.ndarray, np.ndarray]


# Tokens in a batch below which LayerNorm, GELU and attention run on the calling thread alone (the
# linear layers always take the pool). At 12 tokens (one sentence) these jobs take 6, 33 and 16 us on
# one thread (relaxed SIMD, Node, AMD EPYC), about what a helper costs to wake from its sleep (6-60 us
# per job, measured quiet) and less than it waits to be scheduled on a loaded machine (~90 us per job
# at load 10, where two threads took 95-110 us for each of them); at 64 tokens GELU and attention take
# ~170 and ~70 us alone, worth splitting. The JS model reads it from export.py's file (min_pool_tokens).
MIN_POOL_TOKENS = 64

# The Q8_0 scales quantize_q8_0_searched tries for each block, as multiples of amax / 127: steps of
# 0.005 from 0.85 to 1.05. Measured with --budget's float64 models (the weights' share of 1 - cos):
# 0.7..1.1 in the same steps 7.97e-5, this range 8.08e-5 (noise), 0.7..1.1 in steps of 0.01 8.46e-5.
Q8_0_SCALE_STEPS = np.linspace(0.85, 1.05, 41)


def _nearest_q8(xb: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Each value of the 32-blocks xb[..., 32] as the nearest multiple of its block's d in [-127, 127] x d
    (0 where d is 0: the block is all zeros), f32."""
    q = np.divide(xb, d[..., None], out=np.zeros_like(xb), where=d[..., None] != 0)
    return np.clip(np.rint(q), -127, 127)


def quantize_q8_0_searched(x: np.ndarray) -> np.ndarray:
    """f32[rows, k] -> GGUF Q8_0 blocks (llama.cpp's layout, as reference.quantize_q8_0 makes), each
    block's scale the one of Q8_0_SCALE_STEPS x amax / 127 (rounded to its f16) whose block has the
    least squared error, each weight the nearest step for it. Why: amax / 127 puts the largest weight
    on the grid and leaves the other 31 where they fall; a step a little finer (the largest weight
    clamped to 127) or coarser often fits the block better - the scale search llama.cpp's
    make_qx_quants does for its other types. amax / 127 is a candidate (kept on ties), so no block is
    worse than reference.quantize_q8_0's. Data-free: it reads the weights only. Measured in
    tests/minilm_table.py --budget (float64 model, 1 - cosine to the reference over the corpus): the
    Q8_0 weights' share 1.01e-4 -> 8.1e-5; weights and int8 activations 2.46e-4 -> 2.2e-4."""
    x = np.asarray(x, np.float32)
    xb = x.reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(xb).max(axis=-1)
    f16 = lambda step: (amax * np.float32(step / 127)).astype(np.float16).astype(np.float32)  # noqa: E731
    error = lambda d: ((_nearest_q8(xb, d) * d[..., None] - xb) ** 2).sum(axis=-1)  # noqa: E731
    best_d = f16(1.0)
    best = error(best_d)
    for step in Q8_0_SCALE_STEPS:
        d = f16(step)
        e = error(d)
        better = e < best
        best_d, best = np.where(better, d, best_d), np.where(better, e, best)
    out = np.empty(xb.shape[:-1], reference.Q8_0)
    out["d"] = best_d.astype(np.float16)
    out["qs"] = _nearest_q8(xb, best_d).astype(np.int8)
    return out


# The linear layers' quant types: the quantizer that makes each one's stored blocks (llama.cpp's
# reference quantizers byte for byte, but for Q8_0's searched scales and the K-quants, whose scale
# search follows llama.cpp's without its bytes: kernelgen.reference).
QUANTIZERS = {"q8_0": quantize_q8_0_searched, "q4_0": reference.quantize_q4_0, "q5_0": reference.quantize_q5_0,
              "q5_1": reference.quantize_q5_1, "q4_k": lambda x: reference.quantize_k(x, 4),
              "q6_k": reference.quantize_q6_k}

# The linear layers of each encoder layer, by the names prepare gives them.
LINEARS = ("qkv", "out", "ffn1", "ffn2")


def q4_k_m(layer: int, name: str, k: int, layers: int) -> str:
    """The type llama.cpp's Q4_K_M gives one of this model's linear layers (llama_tensor_get_type in
    llama-quant.cpp): Q4_K; a fused QKV matrix Q5_K; the FFN's down projection (ffn2) Q6_K in the
    layers its use_more_bits picks (the first and last eighth, every third between: 2 and 5 of 6);
    and where a row of `k` values is not a multiple of 256, the type it writes instead, Q5_0 for
    Q4_K, Q5_1 for Q5_K, Q8_0 for Q6_K. Here: QKV Q5_1, the attention output and FFN1 Q5_0 (rows of
    384), FFN2 Q6_K or Q4_K (rows of 1536): what `llama-quantize ... Q4_K_M` makes of a BERT with
    fused QKV, with this project's quantizers (QUANTIZERS) in place of llama.cpp's."""
    more = layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2
    kind = {"qkv": "q5_k", "ffn2": "q6_k" if more else "q4_k"}.get(name, "q4_k")
    return kind if k % 256 == 0 else {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}[kind]


# Quant mixes: a type per linear layer, chosen as a quantizer program would.
MIXES = {"q4_k_m": q4_k_m}
# What `quant` may name: a type of 32-value blocks for every layer (the K-quants' 256 divide only
# FFN2's rows), or a mix.
QUANTS = (*(q for q in QUANTIZERS if not q.endswith("_k")), *MIXES)


def linear_types(quant: str, config: dict) -> dict[str, str]:
    """Each linear layer's quant type ("{layer}.{linear}" -> a QUANTIZERS key): `quant` itself, or
    a mix's choice from the layer's index, kind and row length."""
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {', '.join(QUANTS)}, got {quant!r}")
    layers = config["num_hidden_layers"]
    k = lambda name: config["intermediate_size"] if name == "ffn2" else config["hidden_size"]  # noqa: E731
    return {f"{i}.{name}": quant if quant in QUANTIZERS else MIXES[quant](i, name, k(name), layers)
            for i in range(layers) for name in LINEARS}


def channel_order(w: dict[str, np.ndarray], layers: int) -> np.ndarray:
    """The hidden channels by decreasing gamma^2 + beta^2 summed over the model's LayerNorms. Why:
    the linear layers' inputs are quantized per 32 channels with one scale (quantize_act), and the
    QKV and FFN1 inputs are LayerNorm outputs, where a few channels (99, 223 and 157 in this model)
    are 7-10x the median: each coarsens the other 31 of its block. LayerNorm's gamma and beta set
    each channel's size, so this order (from the weights, no data) puts the large ones in the same
    blocks. Measured on the corpus against the float64 reference (Q8_0, both targets): 1 - cosine
    3.37e-4 -> 2.48e-4 on average, the worst sentence's 2.2e-3 -> 1.6e-3, query-sentence scores off
    by 1.73e-3 -> 1.46e-3 on average (README.md, "A real model").
    Tried on top of it (float64 models as tests/minilm_table.py --budget's; 1 - cosine 2.21e-4 with
    Q8_0 weights and int8 inputs), neither worth a kernel change: dividing the QKV and FFN1 inputs
    per channel by size ** (alpha / 2) and multiplying the weights' columns by it (SmoothQuant's
    move, data-free): alpha 0.25 2.10e-4, 0.5 2.35e-4, 1 2.78e-4; the least-squares activation
    scale per block (amax / 127 times 0.7..1.05, as quantize_q8_0_searched does for weights):
    2.13e-4."""
    norms = ["embeddings.LayerNorm."] + [f"encoder.layer.{i}.{p}" for i in range(layers)
                                        for p in ("attention.output.LayerNorm.", "output.LayerNorm.")]
    size = sum(w[p + "weight"].astype(np.float64) ** 2 + w[p + "bias"].astype(np.float64) ** 2 for p in norms)
    return np.argsort(-size, kind="stable").astype(np.int32)


def arrange(safetensors_file: Path, config: dict) -> dict[str, np.ndarray]:
    """The model's tensors as kernelgen runs them, by name, all f32 (the linear layers' weights not yet
    quantized, under "{layer}.{linear}.w", LINEARS): the query weights and bias pre-scaled by
    1 / sqrt(head size) (scores are q . k / sqrt(d)), Q/K/V as one matrix, the hidden channels in
    channel_order, which "order" holds (embed puts the output back in the model's order: the same
    model up to the order of its hidden channels, and exact in real arithmetic)."""
    from safetensors.numpy import load_file

    w = load_file(str(safetensors_file))
    order = channel_order(w, config["num_hidden_layers"])
    scale = np.float32(1 / math.sqrt(config["hidden_size"] // config["num_attention_heads"]))
    f32 = lambda a: np.ascontiguousarray(a, np.float32)  # noqa: E731
    t = {"word": f32(w["embeddings.word_embeddings.weight"][:, order]),
         "pos": f32(w["embeddings.position_embeddings.weight"][:, order]),
         "type0": f32(w["embeddings.token_type_embeddings.weight"][0, order]),
         "ln0.gamma": f32(w["embeddings.LayerNorm.weight"][order]), "ln0.beta": f32(w["embeddings.LayerNorm.bias"][order]),
         "order": order}
    for i in range(config["num_hidden_layers"]):
        g = lambda name: w[f"encoder.layer.{i}.{name}"]  # noqa: E731
        a = "attention.self."
        # Layers reading the hidden state take its channels in order as inputs (columns); layers
        # writing it, as outputs (rows and bias).
        linears = {
            "qkv": (np.concatenate([g(a + "query.weight") * scale, g(a + "key.weight"), g(a + "value.weight")])[:, order],
                    np.concatenate([g(a + "query.bias") * scale, g(a + "key.bias"), g(a + "value.bias")])),
            "out": (g("attention.output.dense.weight")[order], g("attention.output.dense.bias")[order]),
            "ffn1": (g("intermediate.dense.weight")[:, order], g("intermediate.dense.bias")),
            "ffn2": (g("output.dense.weight")[order], g("output.dense.bias")[order])}
        for name, (weight, bias) in linears.items():
            t[f"{i}.{name}.w"] = f32(weight)
            t[f"{i}.{name}.b"] = f32(bias)
        for name, prefix in (("ln1", "attention.output.LayerNorm."), ("ln2", "output.LayerNorm.")):
            t[f"{i}.{name}.gamma"] = f32(g(prefix + "weight")[order])
            t[f"{i}.{name}.beta"] = f32(g(prefix + "bias")[order])
    return t


def prepare(safetensors_file: Path, config: dict, quant: str = "q8_0") -> dict[str, np.ndarray]:
    """arrange's tensors with each linear layer's weights as stored blocks of its linear_types type
    (structured, rows x blocks; QUANTIZERS makes them). The Python model packs these, and export.py
    writes them for the JS model (minilm.mjs)."""
    types = linear_types(quant, config)
    return {name: QUANTIZERS[types[name.removesuffix(".w")]](a) if name.endswith(".w") else a
            for name, a in arrange(safetensors_file, config).items()}


class MiniLM:
    """The model on one kernelgen module; `embed(batch, pool)` gives unit-length f32[batch, 384]."""

    def __init__(self, kernels: Kernels, safetensors_file: Path, config: dict, quant: str = "q8_0") -> None:
        t = prepare(safetensors_file, config, quant)
        self.k = kernels
        self.quant = quant
        self.heads: int = config["num_attention_heads"]
        self.hidden: int = config["hidden_size"]
        self.eps: float = config["layer_norm_eps"]
        self.word, self.pos, self.type0, self.order = t["word"], t["pos"], t["type0"], t["order"]
        self.ln0 = (t["ln0.gamma"], t["ln0.beta"])
        self.types = linear_types(quant, config)
        linear = lambda i, name: Linear(self.k.pack(self.types[f"{i}.{name}"], t[f"{i}.{name}.w"]),  # noqa: E731
                                        t[f"{i}.{name}.b"])
        norm = lambda i, name: (t[f"{i}.{name}.gamma"], t[f"{i}.{name}.beta"])  # noqa: E731
        self.layers = [EncoderLayer(linear(i, "qkv"), linear(i, "out"), norm(i, "ln1"), linear(i, "ffn1"),
                                    linear(i, "ffn2"), norm(i, "ln2"))
                       for i in range(config["num_hidden_layers"])]

    def _project(self, layer: Linear, x: np.ndarray, pool: Pool | None, bias: bool = False) -> np.ndarray:
        """x[tokens, in] -> x W^T (+ b with `bias`; else the next kernel adds it), f32[tokens, out]."""
        return self.k.linear(layer.w, x, layer.b if bias else None, pool)

    def embed(self, batch: inputs.Batch, pool: Pool | None = None) -> np.ndarray:
        """Unit-length sentence embeddings, f32[batch, 384]."""
        k = self.k
        lengths = batch.lengths.tolist()
        # Only real tokens are computed: rows of all sentences one after another.
        ids = np.concatenate([row[:n] for row, n in zip(batch.ids, lengths)])
        if ids.min() < 0 or ids.max() >= len(self.word) or max(lengths) > len(self.pos):
            raise ValueError(f"embed: token ids must lie in 0..{len(self.word) - 1} and sentences hold at most"
                             f" {len(self.pos)} tokens, got ids {ids.min()}..{ids.max()} and {max(lengths)} tokens")
        positions = np.concatenate([np.arange(n) for n in lengths])
        rows = None if len(ids) < MIN_POOL_TOKENS else pool
        x = k.layernorm_f32(self.word[ids], *self.ln0, self.eps, residual=self.pos[positions], bias=self.type0,
                            pool=rows)
        for L in self.layers:
            qkv = self._project(L.qkv, x, pool, bias=True)
            ctx = k.attention_f32(qkv, lengths, self.heads, rows)
            x = k.layernorm_f32(self._project(L.out, ctx, pool), *L.ln1, self.eps, residual=x, bias=L.out.b, pool=rows)
            f = k.gelu_f32(self._project(L.ffn1, x, pool), L.ffn1.b, rows)
            x = k.layernorm_f32(self._project(L.ffn2, f, pool), *L.ln2, self.eps, residual=x, bias=L.ffn2.b, pool=rows)
        padded = np.zeros((*batch.ids.shape, self.hidden), np.float32)
        padded[batch.mask > 0] = x  # row-major order of the mask's ones is the rows' order
        e = k.l2_normalize_f32(k.mean_pool_f32(padded, batch.mask))
        out = np.empty_like(e)
        out[:, self.order] = e  # the model's channel order (prepare)
        return out


def load_model(target: str = "relaxed-simd", quant: str = "q8_0", out_dir: Path | None = None) -> MiniLM:
    """The model on the committed build of `target` (out/ beside examples/ unless given)."""
    out = out_dir or Path(__file__).resolve().parents[2] / "out"
    return MiniLM(kernelgen.load(out, target), inputs.safetensors_path(), inputs.config(), quant)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sentences", nargs="+")
    ap.add_argument("--target", default="relaxed-simd", choices=("simd128", "relaxed-simd"))
    ap.add_argument("--quant", default="q8_0", choices=QUANTS)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    model = load_model(args.target, args.quant)
    batch = inputs.tokenize(args.sentences)
    if args.threads > 1:
        with model.k.pool(args.threads) as pool:
            e = model.embed(batch, pool)
    else:
        e = model.embed(batch)
    np.set_printoptions(precision=4, suppress=True)
    for s, v in zip(args.sentences, e):
        print(f"{s[:60]!r}: {v[:6]} ...")
    if len(args.sentences) > 1:
        print("cosine similarities:\n", e @ e.T)


if __name__ == "__main__":
    main()

"""An independent float64 numpy implementation of all-MiniLM-L6-v2 (BERT encoder + mean pooling +
L2 normalisation), the reference kernelgen's embeddings are checked against. It reads the same
safetensors file and uses no kernelgen code; attention masks the padded keys of a batch.

BERT, as the model's config.json describes it (hidden 384, 12 heads, 6 layers, FFN 1536, erf GELU,
LayerNorm eps 1e-12, absolute positions, token type 0 throughout):
    x = LN(word[ids] + pos[0..T) + type[0])
    per layer: a = softmax(Q K^T / sqrt(d) + mask) V per head;  x = LN(x + a Wo^T + bo)
               x = LN(x + gelu(x W1^T + b1) W2^T + b2)
    embedding = normalize(sum_t mask_t x_t / sum_t mask_t)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np


def _erf(x: np.ndarray) -> np.ndarray:
    """math.erf elementwise (numpy has no erf; this is faster than np.vectorize)."""
    return np.fromiter(map(math.erf, x.ravel().tolist()), np.float64, x.size).reshape(x.shape)


@dataclass(frozen=True)
class Layer:
    wq: np.ndarray
    bq: np.ndarray
    wk: np.ndarray
    bk: np.ndarray
    wv: np.ndarray
    bv: np.ndarray
    wo: np.ndarray
    bo: np.ndarray
    ln1: tuple[np.ndarray, np.ndarray]
    w1: np.ndarray
    b1: np.ndarray
    w2: np.ndarray
    b2: np.ndarray
    ln2: tuple[np.ndarray, np.ndarray]


class BertReference:
    """all-MiniLM-L6-v2 in float64."""

    def __init__(self, safetensors_file: Path, config: dict) -> None:
        from safetensors.numpy import load_file

        w = {k: v.astype(np.float64) for k, v in load_file(str(safetensors_file)).items()}
        self.heads: int = config["num_attention_heads"]
        self.eps: float = config["layer_norm_eps"]
        assert config["hidden_act"] == "gelu" and config["position_embedding_type"] == "absolute", config
        self.word = w["embeddings.word_embeddings.weight"]
        self.pos = w["embeddings.position_embeddings.weight"]
        self.type0 = w["embeddings.token_type_embeddings.weight"][0]
        self.ln0 = (w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"])
        self.layers = []
        for i in range(config["num_hidden_layers"]):
            p = f"encoder.layer.{i}."
            g = lambda name: w[p + name]  # noqa: E731
            self.layers.append(Layer(
                g("attention.self.query.weight"), g("attention.self.query.bias"),
                g("attention.self.key.weight"), g("attention.self.key.bias"),
                g("attention.self.value.weight"), g("attention.self.value.bias"),
                g("attention.output.dense.weight"), g("attention.output.dense.bias"),
                (g("attention.output.LayerNorm.weight"), g("attention.output.LayerNorm.bias")),
                g("intermediate.dense.weight"), g("intermediate.dense.bias"),
                g("output.dense.weight"), g("output.dense.bias"),
                (g("output.LayerNorm.weight"), g("output.LayerNorm.bias"))))

    def layer_norm(self, x: np.ndarray, gb: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + self.eps) * gb[0] + gb[1]

    @staticmethod
    def linear(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
        """x W^T + b over the last axis (as one 2-D product: numpy's batched 3-D matmul is far slower)."""
        return (x.reshape(-1, x.shape[-1]) @ w.T + b).reshape(*x.shape[:-1], w.shape[0])

    def attention(self, x: np.ndarray, mask: np.ndarray, L: Layer) -> np.ndarray:
        b, t, n = x.shape
        d = n // self.heads
        split = lambda y: y.reshape(b, t, self.heads, d).transpose(0, 2, 1, 3)  # noqa: E731  [b, h, t, d]
        q, k, v = split(self.linear(x, L.wq, L.bq)), split(self.linear(x, L.wk, L.bk)), split(self.linear(x, L.wv, L.bv))
        s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d)
        s = np.where(mask[:, None, None, :] > 0, s, -np.inf)  # padded keys get no weight
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        return self.linear((p @ v).transpose(0, 2, 1, 3).reshape(b, t, n), L.wo, L.bo)

    def hidden(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """The last hidden state, [batch, T, 384] (what the ONNX model outputs)."""
        t = ids.shape[1]
        x = self.layer_norm(self.word[ids] + self.pos[:t] + self.type0, self.ln0)
        for L in self.layers:
            x = self.layer_norm(x + self.attention(x, mask, L), L.ln1)
            f = self.linear(x, L.w1, L.b1)
            f = 0.5 * f * (1.0 + _erf(f / math.sqrt(2.0)))
            x = self.layer_norm(x + self.linear(f, L.w2, L.b2), L.ln2)
        return x

    def embed(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return pool_and_normalize(self.hidden(ids, mask), mask)


def pool_and_normalize(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Mean over the unmasked tokens, then unit length (sentence-transformers' Pooling + Normalize)."""
    m = mask.astype(np.float64)[:, :, None]
    pooled = (hidden * m).sum(1) / np.maximum(m.sum(1), 1e-9)
    return pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)


def onnx_embedder(onnx_file: Path):
    """The peer: onnxruntime (CPU) on the int8 ONNX model, its last hidden state pooled as above.
    Returns embed(batch) -> [batch, 384] float64 for a tokenized batch (ids, mask)."""
    import onnxruntime

    opts = onnxruntime.SessionOptions()
    opts.log_severity_level = 3
    session = onnxruntime.InferenceSession(str(onnx_file), opts, providers=["CPUExecutionProvider"])

    def embed(batch) -> np.ndarray:
        (h,) = session.run(None, {"input_ids": batch.ids, "attention_mask": batch.mask,
                                  "token_type_ids": np.zeros_like(batch.ids)})
        return pool_and_normalize(h.astype(np.float64), batch.mask)

    return embed


@dataclass(frozen=True)
class Agreement:
    """How closely embeddings follow the reference's: per-sentence cosine, and whether searching the
    corpus with the queries finds the same sentences."""

    cos_mean: float
    cos_min: float
    top1: float   # share of queries whose best sentence is the reference's
    top5: float   # mean share of the reference's top 5 found in the top 5
    score_error: float  # mean |query . sentence score - the reference's| (what moves the top 5)

    def row(self, name: str) -> str:
        return (f"{name:<34} {self.cos_mean:9.6f} {1 - self.cos_mean:9.2e} {self.cos_min:9.6f} {self.top1:6.0%}"
                f" {self.top5:6.1%} {self.score_error:9.2e}")

    def short_of(self, floors: dict[str, float]) -> list[str]:
        """The figures below their floor (e.g. GOALS), each named with its value."""
        return [f"{name} {getattr(self, name):.6g} < {floor}" for name, floor in floors.items()
                if getattr(self, name) < floor]

    def worse_than(self, peer: Agreement) -> list[str]:
        """The figures on which these embeddings are further from the reference than peer's."""
        worse = [f for f in ("cos_mean", "cos_min", "top1", "top5") if getattr(self, f) < getattr(peer, f)]
        worse += ["score_error"] * (self.score_error > peer.score_error)
        return [f"{f} {getattr(self, f):.6g} vs {getattr(peer, f):.6g}" for f in worse]


# Issue 15's accuracy floors for kernelgen Q8_0 on the whole corpus (and: no figure worse than
# onnxruntime's int8 model, Agreement.worse_than).
GOALS = {"cos_mean": 0.999, "cos_min": 0.995, "top1": 0.98, "top5": 0.9}


HEADER = (f"{'embeddings':<34} {'cos mean':>9} {'1 - mean':>9} {'cos min':>9} {'top-1':>6} {'top-5':>6}"
          f" {'score err':>9}")


def agreement(reference: tuple[np.ndarray, np.ndarray], got: tuple[np.ndarray, np.ndarray]) -> Agreement:
    """Each a pair (corpus embeddings [n, dim], query embeddings [queries, dim]); the reference's unit length."""
    (ref, ref_q), (got, got_q) = reference, got
    cos = np.concatenate([(ref * got).sum(1) / np.linalg.norm(got, axis=1),
                          (ref_q * got_q).sum(1) / np.linalg.norm(got_q, axis=1)])
    ref_scores, got_scores = ref_q @ ref.T, got_q.astype(np.float64) @ got.astype(np.float64).T
    top = lambda scores: np.argsort(-scores, axis=1, kind="stable")[:, :5]  # noqa: E731
    r, g = top(ref_scores), top(got_scores)
    overlap = np.mean([len(set(a) & set(b)) / 5 for a, b in zip(r, g)])
    return Agreement(float(cos.mean()), float(cos.min()), float(np.mean(r[:, 0] == g[:, 0])), float(overlap),
                     float(np.abs(got_scores - ref_scores).mean()))

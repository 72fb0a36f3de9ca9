"""The accuracy table of all-MiniLM-L6-v2 embeddings against the float64 reference: kernelgen Q8_0
and Q4_0 on each target and onnxruntime's int8 model, over the corpus and queries of examples/minilm/.

    python tests/minilm_table.py            # the whole corpus (a few minutes: see minilm.py's note)

tests/test_minilm.py runs the same comparison (Q8_0) on a subset.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "examples" / "minilm")]

import inputs  # noqa: E402
import minilm  # noqa: E402
from minilm_reference import HEADER, Agreement, BertReference, agreement, onnx_embedder  # noqa: E402

TARGETS = ("simd128", "relaxed-simd")
Embeddings = tuple[np.ndarray, np.ndarray]  # corpus, queries


def embed_both(embed, sentences: list[str], queries: list[str]) -> Embeddings:
    return inputs.embed_all(embed, sentences), inputs.embed_all(embed, queries)


def reference_embeddings(sentences: list[str], queries: list[str]) -> Embeddings:
    ref = BertReference(inputs.safetensors_path(), inputs.config())
    return embed_both(lambda b: ref.embed(b.ids, b.mask), sentences, queries)


def peer_rows(ref: Embeddings, sentences: list[str], queries: list[str], quants: tuple[str, ...] = ("q8_0",)
              ) -> dict[str, Agreement]:
    """kernelgen on every target in each quant type, and onnxruntime int8, each against the reference."""
    rows = {}
    for quant in quants:
        for target in TARGETS:
            model = minilm.load_model(target, quant)
            rows[f"kernelgen {target} {quant}"] = agreement(ref, embed_both(model.embed, sentences, queries))
            model.k.reset()
    rows["onnxruntime int8"] = agreement(ref, embed_both(onnx_embedder(inputs.onnx_path()), sentences, queries))
    return rows


def main() -> None:
    sentences, queries = inputs.corpus()
    t0 = time.perf_counter()
    ref = reference_embeddings(sentences, queries)
    rows = peer_rows(ref, sentences, queries, tuple(minilm.QUANTIZERS))
    tokens = int(inputs.tokenize(sentences).lengths.sum() + inputs.tokenize(queries).lengths.sum())
    print(f"{len(sentences)} sentences, {len(queries)} queries, {tokens} tokens; {time.perf_counter() - t0:.0f} s")
    print(HEADER)
    for name, row in rows.items():
        print(row.row(name))


if __name__ == "__main__":
    main()

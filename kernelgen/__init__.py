"""kernelgen: a compiler from a small kernel language to WebAssembly SIMD128 and relaxed SIMD."""
__version__ = "0.1.0"

from .api import Act, Kernels, Packed, compile_kernels, load  # noqa: E402  (needs __version__)

__all__ = ["Act", "Kernels", "Packed", "compile_kernels", "load", "__version__"]

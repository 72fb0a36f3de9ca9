"""kernelgen: a compiler from a small kernel language to WebAssembly SIMD128 and relaxed SIMD."""
__version__ = "0.1.0"

from .host.api import Act, Kernels, Packed, load, padded_rows  # noqa: E402  (needs __version__)

__all__ = ["Act", "Kernels", "Packed", "compile_kernels", "load", "padded_rows", "__version__"]


def __getattr__(name: str):
    """`kernelgen.compile_kernels` imports the compiler (lark, jinja2, wabt) on first use only, so
    loading a built library needs none of them."""
    if name == "compile_kernels":
        from .compiler.build import compile_kernels
        return compile_kernels
    raise AttributeError(f"module 'kernelgen' has no attribute {name!r}")

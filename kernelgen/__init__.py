"""kernelgen: a compiler from a small kernel language to WebAssembly SIMD128 and relaxed SIMD."""
__version__ = "0.1.0"

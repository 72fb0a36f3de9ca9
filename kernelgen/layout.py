"""The shared memory's fixed layout, named once here and published in every manifest.

[0, HEAP_BASE)  fixed-address state: words shared by every instance on the memory (globals are
                per instance, so anything threads share lives at a named address); each busy
                word gets its own 64-byte line.
[HEAP_BASE, ..) buffers the host allocates (weights, activations, outputs), 64-byte aligned.
"""
from __future__ import annotations

CACHE_LINE = 64
HEAP_BASE = 4096
MIN_PAGES = 1  # the host grows the memory as it allocates
MAX_PAGES = 32768  # 2 GiB: a shared memory must declare its maximum


def describe() -> dict:
    return {"min_pages": MIN_PAGES, "max_pages": MAX_PAGES, "heap_base": HEAP_BASE, "shared": True,
            "align": CACHE_LINE, "fixed": {}}

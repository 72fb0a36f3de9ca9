"""Semantics of the language itself, on small kernels written here: inline expansion, compile-time
control flow, loops, integer folding, calls between kernels, the pool's atomics."""
from __future__ import annotations

import numpy as np
import pytest

from kernelgen.names import parse_variant

from kernelgen.compiler.build import compile_kernels

TARGETS = ("simd128", "relaxed-simd")

SOURCE = """
inline kernel sq(x: i32) -> i32 {
    var t: i32 = x;
    t = t * x;
    return t;
}

# Two expansions of one inline kernel in one expression: each keeps its own value.
export kernel two_inlines(a: i32, b: i32) -> i32 {
    return sq(a) * 1000 + sq(b);
}

inline kernel pick[FIRST: i32](a: i32, b: i32) -> i32 {
    var r: i32 = b;
    static if FIRST {
        r = a;
    }
    return r;
}

export kernel static_choice(a: i32, b: i32) -> i32 {
    static if 1 == 1 {
        let visible = pick[1](a, b) * 10 + pick[0](a, b);
    }
    return visible;
}

# An inline kernel's value may come from the taken arm of a final static if; a constant argument
# (the zero vector) reaches the ops as a constant.
inline kernel arm[FIRST: i32](acc: i32x4, a: i32) -> i32x4 {
    var lift: i32 = a;
    lift = lift + 1;
    static if FIRST {
        return acc + i32x4.splat(lift * 10);
    } else {
        return acc - i32x4.splat(lift);
    }
}

export kernel static_arms(a: i32) -> i32 {
    let v = arm[0](arm[1](i32x4.splat(0), a), a);
    return extract(v, 0) * 1000 + extract(arm[1](i32x4.splat(7), a), 3);
}

# `for k in x..x + N`: N = 1 is one round, the body with k bound to x (no loop); more, a loop.
kernel rounds[N: i32](n: i32) -> i32 {
    var s: i32 = 0;
    for b in 0..n step N {
        for k in b..b + N {
            s = s + k * k;
        }
        s = s + 1000;
    }
    return s;
}

export kernel rounds_1(n: i32) -> i32 {
    return rounds[1](n);
}

export kernel rounds_4(n: i32) -> i32 {
    return rounds[4](n);
}

export kernel while_count(n: i32) -> i32 {
    var i: i32 = 0;
    var s: i32 = 0;
    while i < n {
        s = s + i;
        i = i + 1;
    }
    return s;
}

export kernel unrolled(p: ptr) {
    unroll j in 0..4 {
        i32.store(p, j * 4, j * j);
    }
}

export kernel folds() -> i32 {
    return (-7 / 2) * 100 + (-7 % 2) * 10 + (1 << 3) - (08 - 8);
}

export kernel mins(a: i32, b: i32) -> i32 {
    return min(a, b) * 1000 + max(a, b);
}

kernel helper[N: i32](x: i32) -> i32 {
    return x * N;
}

kernel bump(p: ptr) -> i32 {
    i32.store(p, i32.load(p) + 1);
    return 3;
}

# Integer identities the lowering removes (x * 1, 1 * x, 0 + x, x * 0) and keeps where an operand
# has an effect: bump's store, and a load that may trap.
export kernel identities(x: i32, p: ptr) -> i32 {
    var s: i32 = 0;
    unroll r in 0..2 {
        s = s + r * x + x * r + (0 + r) * 100;
    }
    let z = bump(p) * 0 + i32.load(p + 4) * 0;
    return s + z;
}

export kernel generic_calls(x: i32) -> i32 {
    return helper[2](x) + helper[3](x) + helper[2](x);
}

# A function (not inline) taking and returning a vector: its wasm type is v128.
kernel twice4(v: f32x4) -> f32x4 {
    return v + v;
}

export kernel vector_calls(x: f32) -> f32 {
    let v = twice4(twice4(f32x4.splat(x)));
    return extract(v, 0) + extract(v, 3);
}

# hsum of four vectors at once (one vector of sums) beside four single hsums: p holds four f32x4
# (or i32x4) inputs; the vector sum goes to p + 64, the single ones to p + 80 .. p + 92.
export kernel hsums_f32(p: ptr) {
    f32x4.store(p + 64, hsum(f32x4.load(p), f32x4.load(p + 16), f32x4.load(p + 32), f32x4.load(p + 48)));
    unroll j in 0..4 {
        f32.store(p + 80 + j * 4, hsum(f32x4.load(p + j * 16)));
    }
}

export kernel hsums_i32(p: ptr) {
    i32x4.store(p + 64, hsum(i32x4.load(p), i32x4.load(p + 16), i32x4.load(p + 32), i32x4.load(p + 48)));
    unroll j in 0..4 {
        i32.store(p + 80 + j * 4, hsum(i32x4.load(p + j * 16)));
    }
}

# Stores the emitter drops (wat.drop_dead_stores) beside the ones it must keep: a loop-carried
# value, a zero a loop needs on every pass, a store read after a loop.
export kernel stores(n: i32) -> i32 {
    var total: i32 = 0;
    var last: i32 = 7;
    var dead: i32 = 0;
    dead = n * 3;
    for i in 0..n {
        var acc: i32 = 0;
        for j in 0..i {
            acc = acc + 1;
        }
        total = total * 10 + acc + last;
        last = i;
    }
    return total * 100 + last * 10 + dead;
}

export kernel widen8(src: ptr, dst: ptr) {
    i16x8.store(dst, i16x8.load8x8(src, 4));
}

# Equal vector loads read once (Lowerer.load_once) while their address's locals stay as they are.
export kernel shared_loads(src: ptr, dst: ptr, k: i32) {
    let a = i32x4.load(src + k * 16, 16);
    let b = i32x4.load(src + k * 16, 16);
    var p: ptr = src + k * 16;
    let c = i32x4.load(p);
    p = p + 16;
    let d = i32x4.load(p);
    i32x4.store(dst, a + b * i32x4.splat(10) + c * i32x4.splat(100) + d * i32x4.splat(1000));
}

# Shuffles with a constant zero operand (relaxed SIMD: a relaxed swizzle) and with -0.0 (not zero bits).
export kernel zero_shuffles(src: ptr, dst: ptr) {
    let v = i8x16.load(src);
    i8x16.store(dst, i8x16.shuffle(v, i8x16.splat(0), 4, 16, 16, 16, 5, 17, 18, 19, 0, 1, 31, 15, 7, 16, 3, 2));
    i8x16.store(dst, 16, i8x16.shuffle(i8x16.splat(0), v, 16, 0, 31, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7));
    let f = f32x4.load(src);
    f32x4.store(dst, 32, f32x4.shuffle(f, f32x4.splat(0.0), 0, 4, 3, 5));
    f32x4.store(dst, 48, f32x4.shuffle(f, f32x4.splat(-0.0), 0, 4, 3, 5));
}

# An inline kernel that returns nothing, called as the last statement of an arm of another inline
# kernel's if (a partial-vector store helper once failed to assemble so): its body is the arm's end.
inline kernel put_tail(p: ptr, v: i32, n: i32) {
    i32.store(p, v);
    if n > 1 {
        i32.store(p + 4, v + 1);
    }
}

inline kernel put_head(p: ptr, v: i32, n: i32) {
    if n >= 4 {
        i32.store(p, v * 10);
    } else {
        put_tail(p, v, n);
    }
}

export kernel put(p: ptr, v: i32, n: i32) {
    put_head(p, v, n);
}

export kernel atomics(p: ptr) -> i32 {
    atomic_store(p, 5);
    let old = atomic_add(p, 3);
    let swapped = atomic_cmpxchg(p, 8, 100);
    let waited = wait32(p, 7, 0);
    return old * 1000000 + swapped * 1000 + atomic_load(p) + waited * 10000000;
}
"""


@pytest.fixture(scope="module", params=TARGETS)
def k(request):
    return compile_kernels(SOURCE, request.param)


def test_generic_kernel_instances_and_unroll_offsets_in_the_wat() -> None:
    from kernelgen.compiler.build import compile_source
    (built,) = compile_source(SOURCE, targets=("simd128",))
    # One function per distinct compile-time argument, named as exports are (names.variant_name).
    assert built.wat.count("(func $helper__n2\n") == 1 and built.wat.count("(func $helper__n3\n") == 1
    assert parse_variant("helper__n2").tune == {"n": 2}
    assert "(i32.store offset=12" in built.wat


def test_integer_identities_go_and_effects_stay(k) -> None:
    from kernelgen.compiler.build import compile_source
    (built,) = compile_source(SOURCE, targets=("simd128",))
    body = built.wat.split("(func $identities")[1].split("\n  (func ")[0]
    assert "i32.mul" not in body.split("let z =")[0], body  # r * x, x * r for r = 0, 1: gone
    assert "call $bump" in body and "i32.load" in body  # x * 0 keeps an operand with an effect
    p = k.module.alloc(8)
    assert k.call("identities", 5, p) == 2 * 5 + 100
    assert k.module.get(p, np.int32, 1).tolist() == [1]  # bump ran
    with pytest.raises(Exception, match="out of bounds"):
        k.module.call("identities", 5, 0x7FFFFFF0)  # the load's trap is kept (the raw call: Kernels.call refuses it)


def test_an_inline_call_that_returns_nothing_may_end_an_arm(k) -> None:
    p = k.module.alloc(8)
    for n, want in ((4, [70, 0]), (2, [7, 8]), (1, [7, 0])):
        k.module.view(p, np.int32, 2)[:] = 0
        k.call("put", p, 7, n)
        assert k.module.get(p, np.int32, 2).tolist() == want, n


def test_each_inline_expansion_keeps_its_own_result(k) -> None:
    assert k.call("two_inlines", 3, 4) == 9 * 1000 + 16


def test_static_if_picks_an_arm_and_its_bindings_stay_visible(k) -> None:
    assert k.call("static_choice", 7, 2) == 72


def test_inline_returns_from_the_taken_arm_of_a_final_static_if(k) -> None:
    # arm[1](0, 4) = 50, arm[0](50, 4) = 45; arm[1](7, 4) = 57
    assert k.call("static_arms", 4) == 45 * 1000 + 57
    assert k.call("static_arms", -1) == 0 * 1000 + 7


def test_a_loop_of_one_round_is_its_body(k) -> None:
    squares = sum(i * i for i in range(8))
    assert k.call("rounds_1", 8) == squares + 8 * 1000
    assert k.call("rounds_4", 8) == squares + 2 * 1000
    assert k.call("rounds_1", 0) == 0
    from kernelgen.compiler.build import compile_source
    (built,) = compile_source(SOURCE, targets=("simd128",))
    one = built.wat.split("(func $rounds__n1")[1].split("\n  (func ")[0]
    four = built.wat.split("(func $rounds__n4")[1].split("\n  (func ")[0]
    assert one.count("(loop") == 1 and "$k" not in one, one  # k reads b itself
    assert four.count("(loop") == 2, four


def test_load8x8_widens_eight_int8_at_its_offset(k) -> None:
    raw = np.array([9, 9, 9, 9, -128, 127, -1, 0, 1, -2, 64, -65, 9, 9, 9, 9], np.int8)
    src, dst = k.module.put(raw), k.module.alloc(16)
    k.call("widen8", src, dst)
    assert k.module.get(dst, np.int16, 8).tolist() == raw[4:12].tolist()


@pytest.mark.parametrize("target", TARGETS)
def test_equal_loads_are_read_once_until_their_address_changes(target) -> None:
    from kernelgen.compiler.build import compile_source, from_built
    (built,) = compile_source(SOURCE, targets=(target,))
    k = from_built(built)
    raw = np.arange(48, dtype=np.int32)
    src, dst = k.module.put(raw), k.module.alloc(16)
    k.call("shared_loads", src, dst, 1)
    x = raw.reshape(-1, 4)
    assert k.module.get(dst, np.int32, 4).tolist() == (x[2] * 11 + x[1] * 100 + x[2] * 1000).tolist()
    body = built.wat.split("(func $shared_loads")[1].split("\n  (func ")[0]
    # a and b name one load's local (no copy); c and d differ (p was set between them)
    assert body.count("(v128.load") == 3 and body.count("(local.get $loaded)") == 2, body
    assert "$a" not in body and "$b" not in body, body


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("target", TARGETS)
def test_shuffles_with_a_zero_operand_give_zeros_there(target, deterministic) -> None:
    from kernelgen.compiler.build import compile_source, from_built
    (built,) = compile_source(SOURCE, targets=(target,))
    k = from_built(built, deterministic)
    raw = np.arange(1, 17, dtype=np.uint8) * np.uint8(13)
    src, dst = k.module.put(raw), k.module.alloc(64)
    k.call("zero_shuffles", src, dst)
    both = np.concatenate([raw, np.zeros(16, np.uint8)])
    first = both[[4, 16, 16, 16, 5, 17, 18, 19, 0, 1, 31, 15, 7, 16, 3, 2]]
    second = np.concatenate([np.zeros(16, np.uint8), raw])[[16, 0, 31, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7]]
    words = raw.view(np.uint32)
    floats = [words[0], 0, words[3], 0]
    neg = [words[0], 0x80000000, words[3], 0x80000000]
    got = k.module.get(dst, np.uint8, 64)
    assert got[:16].tolist() == first.tolist() and got[16:32].tolist() == second.tolist()
    assert got[32:].view(np.uint32).tolist() == floats + neg
    body = built.wat.split("(func $zero_shuffles")[1].split("\n  (func ")[0]
    relaxed = target == "relaxed-simd"
    assert body.count("(i8x16.relaxed_swizzle") == (3 if relaxed else 0)
    assert body.count("(i8x16.shuffle") == (1 if relaxed else 4)  # -0.0 has its sign bit: a shuffle


def test_while_loop(k) -> None:
    assert k.call("while_count", 10) == 45
    assert k.call("while_count", 0) == 0


def test_unroll_makes_constant_offsets(k) -> None:
    p = k.module.alloc(16)
    k.call("unrolled", p)
    assert k.module.get(p, np.int32, 4).tolist() == [0, 1, 4, 9]


def test_integer_folding_follows_wasm_semantics(k) -> None:
    # C division and remainder truncate toward zero: -7 / 2 = -3, -7 % 2 = -1; `08` is decimal eight.
    assert k.call("folds") == -300 - 10 + 8 - 0


def test_scalar_integer_min_max(k) -> None:
    assert k.call("mins", 5, -3) == -3 * 1000 + 5


def test_generic_internal_kernels_are_instantiated_once_per_argument(k) -> None:
    assert k.call("generic_calls", 5) == 10 + 15 + 10


def test_a_function_returns_a_vector(k) -> None:
    assert k.call("vector_calls", 1.5) == 12.0


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_hsum_of_four_vectors_is_four_hsums_bit_for_bit(k, dtype) -> None:
    """Lane i of hsum(a, b, c, d) is the ith vector's hsum, pairs first ((0 + 1) + (2 + 3)): floats
    where the order shows (cancellation, 2^24 + 1, inf - inf, NaN, -0), integers that wrap."""
    rng = np.random.default_rng(7)
    if dtype == np.float32:
        cases = [np.array(v, np.float32) for v in (
            [[1e8, 1, -1e8, 1], [2 ** 24, 1, 1, 0], [np.inf, -np.inf, 1, 2], [np.nan, 1, 2, 3]],
            [[-0.0, -0.0, -0.0, -0.0], [1, 2 ** -30, -1, 0], [3e38, 3e38, -3e38, -3e38], [0.1, 0.2, 0.3, 0.4]])]
        cases.append((rng.standard_normal((4, 4)) * 10 ** rng.uniform(-20, 20, (4, 1))).astype(np.float32))
    else:
        cases = [np.array([[2 ** 31 - 1, 1, -2 ** 31, -1], [-2 ** 31] * 4, [0, 0, 0, 1], [5, -6, 7, -8]], np.int32),
                 rng.integers(-2 ** 31, 2 ** 31, (4, 4), dtype=np.int64).astype(np.int32)]
    for v in cases:
        p = k.module.put(np.concatenate([v.ravel(), np.zeros(8, dtype)]))
        k.call(f"hsums_{'f32' if dtype == np.float32 else 'i32'}", p)
        got = k.module.get(p + 64, dtype, 8)
        with np.errstate(all="ignore"):
            want = (v[:, 0] + v[:, 1]) + (v[:, 2] + v[:, 3])
        assert got[:4].tobytes() == got[4:].tobytes() == want.astype(dtype).tobytes(), (v, got, want)


def test_dead_stores_go_and_live_ones_stay(k) -> None:
    from kernelgen.compiler.build import compile_source
    (built,) = compile_source(SOURCE, targets=("simd128",))
    body = built.wat.split("(func $stores")[1].split("\n  (func ")[0]
    assert "(local.set $dead (i32.const 0))" not in body and "(local.set $total (i32.const 0))" not in body, body
    assert "(local.set $acc (i32.const 0))" in body and "(local.set $last (i32.const 7))" in body, body
    # n = 4: passes add acc = 0, 1, 2, 3 and last = 7, 0, 1, 2; then last 3, dead 12
    assert k.call("stores", 4) == 7135 * 100 + 3 * 10 + 12
    assert k.call("stores", 0) == 7 * 10


def test_drop_dead_stores_keeps_what_may_be_read() -> None:
    from kernelgen.compiler.wat import Block, I, Writer, drop_dead_stores

    def kept(body, params=frozenset()) -> list[str]:  # the statements left, each as WAT text
        out = []
        for st in drop_dead_stores(body, set(params)):
            w = Writer()
            w.stmts(0, [st])
            out.append(" ".join(line.strip() for line in w.lines))
        return out

    zero, one = I("i32.const", "0"), I("i32.const", "1")
    get = lambda x: I("local.get", x)  # noqa: E731
    use = lambda x: I("call", "$f", get(x))  # noqa: E731
    # a zero before anything names the local goes (locals start at zero); a parameter's stays
    assert kept([I("local.set", "$x", zero), use("$x")]) == ["(call $f (local.get $x))"]
    assert len(kept([I("local.set", "$p", zero), use("$p")], {"$p"})) == 2
    # -0.0 is not the zero a local starts with; a zero after the local was named is a store
    assert len(kept([I("local.set", "$f", I("f32.const", "-0.0")), use("$f")])) == 2
    assert len(kept([use("$x"), I("local.set", "$x", zero), use("$x")])) == 3
    # overwritten before any read: goes; read (or overwritten by a value that reads it) first: stays
    body = [use("$y"), I("local.set", "$x", one), I("local.set", "$x", get("$z")), use("$x")]
    assert len(kept(body)) == 3
    assert len(kept([use("$y"), I("local.set", "$x", one), I("local.set", "$x", I("i32.add", get("$x"), one))])) == 3
    # a branch or a nested block naming the local between them keeps it, inside a loop too
    for between in (I("br_if", "$l", get("$c")), Block("block", "b", [use("$x")])):
        inner = [I("local.set", "$x", one), between, I("local.set", "$x", zero), use("$x")]
        assert len(kept([Block("loop", "l", inner)])[0].split("local.set $x")) == 3
    # a store with no later overwrite in its own list stays (a loop's next pass may read it)
    assert len(kept([Block("loop", "l", [use("$x"), I("local.set", "$x", one)])])[0].split("local.set")) == 2


def test_forward_copies_take_the_value_straight_to_its_reader() -> None:
    from kernelgen.compiler.wat import Comment, I, Writer, forward_copies

    def text(body, params=frozenset()) -> list[str]:
        w = Writer()
        w.stmts(0, forward_copies(body, set(params)))
        return [line.strip() for line in w.lines]

    e = I("i32.add", I("local.get", "$p"), I("i32.const", "1"))
    use = lambda x: I("call", "$f", I("local.get", x))  # noqa: E731
    copy = lambda dst, src: I("local.set", dst, I("local.get", src))  # noqa: E731
    # an inline kernel's return into a let, a comment between: the value goes to the let's local
    assert text([I("local.set", "$ret", e), Comment("let av"), copy("$av", "$ret"), use("$av")]) == \
        [";; let av", "(local.set $av (i32.add (local.get $p) (i32.const 1)))", "(call $f (local.get $av))"]
    # a chain of copies carries the value to its end
    assert text([I("local.set", "$a", e), copy("$b", "$a"), copy("$c", "$b"), use("$c")]) == \
        ["(local.set $c (i32.add (local.get $p) (i32.const 1)))", "(call $f (local.get $c))"]
    # a local read anywhere else, teed, or a parameter keeps its set and its copy
    kept = [I("local.set", "$a", e), copy("$b", "$a"), use("$a")]
    assert len(text(kept)) == 3
    assert len(text([I("local.set", "$a", e), copy("$b", "$a"), I("drop", I("local.tee", "$a", e))])) == 3
    assert len(text([I("local.set", "$p", e), copy("$b", "$p"), use("$b")], {"$p"})) == 3


def test_every_declared_local_is_used() -> None:
    """The committed library's WAT (test_out_fresh: what a build makes) declares no local its code
    does not name: what the emitter dropped leaves none behind."""
    import re
    from pathlib import Path

    for target in TARGETS:
        wat = (Path(__file__).parents[1] / "out" / target / "kernels.wat").read_text()
        for func in wat.split("\n  (func ")[1:]:
            for name in re.findall(r"\(local \$(\S+) \w+\)", func):
                assert len(re.findall(rf"\${re.escape(name)}\b", func)) > 1, (target, func[:60], name)


def test_atomics(k) -> None:
    p = k.module.alloc(4)
    # store 5, add 3 (old 5), cmpxchg 8 -> 100 (old 8), wait32 with value 100 != 7: returns 1 at once
    assert k.call("atomics", p) == 5 * 1000000 + 8 * 1000 + 100 + 1 * 10000000

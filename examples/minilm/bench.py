"""MiniLM sentences/s, one table from one run: kernelgen's JS model (simd128 and relaxed SIMD) against
onnxruntime-web's wasm backend on the int8 ONNX model, each in Node and in headless Chromium, one and
two threads, batches of 1, 8 and 32 sentences; onnxruntime (Python, native) on the same file for
reference; and where kernelgen's time goes (linear layers with their activation quantization,
attention, the rest: LayerNorm, GELU, pooling).

    python examples/minilm/bench.py [--sentences 32] [--batches 1,8,32] [--threads 1,2] [--repeat 3]
                                    [--rounds 3] [--where node,chromium] [--lib OUT]

kernelgen runs on a library built for the model's one quant type, Q8_0 (`kernelgen build --quant q8_0`,
a few seconds), as a page serving this model would ship it: the whole library's byte budget then goes
to Q8_0's tiles, where the committed out/ (every type in 32 KB) builds its smallest GEMM tile. `--lib
out` (or any build's directory) times that build instead.

Needs node and node_modules (npm ci: onnxruntime-web, playwright-core), /usr/bin/chromium, and the
model packages (inputs.py). Each engine runs in its own Node process or Chromium page (bench.mjs),
which prints its figures as JSON lines; a figure is the median of --repeat timed passes after an
untimed one.

Rounds: the whole sweep runs --rounds times, and the engines that share a place and a thread count
take turns in each round (the order reversed every other round). Why: these machines' speed drifts
by 20-40% over minutes, and a ratio of two figures timed a minute apart carried that drift (the
Chromium batch-32 goal read 0.77-1.93 over one day's single runs). Each ratio is taken within a
round, from figures timed back to back, and the table gives its median over the rounds with the
range; a goal is judged on the median and says in how many rounds it held. sentences/s in the main
table are medians over the rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kernelgen.cli import positive_int
from kernelgen.tuning.v8 import run_group

import export
import inputs

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# Node 20: relaxed SIMD behind a flag, and Liftoff miscompiles its integer dot (runtime/README.md).
NODE_FLAGS = ("--experimental-wasm-relaxed-simd", "--no-liftoff")
TARGETS = ("simd128", "relaxed-simd")
WHERE = {"node": [], "chromium": ["--browser"]}
QUANT = "q8_0"  # the linear layers' type (export.py), and the one the library is built for
BUILD_SECONDS = 600  # the library's build: a few seconds, but a waiting out/ lock or a stuck tool must not hang the bench
ENGINE_SECONDS = 1800  # one engine's figures at every batch size (bench.mjs): a minute or two at the defaults
GOAL_SPEEDUP = 1.5  # Chromium, relaxed SIMD, 2 threads, batch 32, against onnxruntime-web (issue 15)


@dataclass(frozen=True)
class Run:
    """One engine at one thread count and batch size."""

    name: str                      # engine and where it ran, e.g. "kernelgen relaxed-simd (Chromium)"
    threads: int
    batch: int
    per_second: float              # sentences/s of the median pass
    first: np.ndarray              # the first sentence's embedding
    stage_ms: dict | None = None   # kernelgen: ms per stage over the timed passes
    round: int = 0                 # which round of the sweep timed it (the ratios pair runs of a round)

    @property
    def where(self) -> str:
        return self.name[self.name.rindex("(") + 1:-1]


def node_runs(node: str, args: list[str], round_: int) -> list[Run]:
    """bench.mjs's records: it runs the engine in Node, or in Chromium with --browser (in a process
    group of its own, stopped with the browser if it runs past ENGINE_SECONDS)."""
    code, stdout, stderr = run_group([node, *NODE_FLAGS, str(HERE / "bench.mjs"), *args], ENGINE_SECONDS)
    if code is None:
        sys.exit(f"bench.mjs {' '.join(args)}: still running after {ENGINE_SECONDS} s; stopped it")
    if code:
        sys.exit(f"bench.mjs {' '.join(args)}: exit {code}\n{stderr}")
    return [Run(f"{r['engine']} ({r['where']})", r["threads"], r["batch"], r["sentencesPerSecond"],
                np.array(r["first"], np.float32), r["stageMs"], round_)
            for r in map(json.loads, stdout.splitlines())]


def onnxruntime_runs(ids: list[list[int]], batches: list[int], threads: int, repeat: int, round_: int) -> list[Run]:
    """onnxruntime (Python, CPU) timed as bench.mjs times its engines."""
    import onnxruntime

    opts = onnxruntime.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads, opts.log_severity_level = threads, 1, 3
    session = onnxruntime.InferenceSession(str(inputs.onnx_path()), opts, providers=["CPUExecutionProvider"])

    def embed(group: list[list[int]]) -> np.ndarray:
        width = max(map(len, group))
        x = np.zeros((len(group), width), np.int64)
        mask = np.zeros_like(x)
        for i, s in enumerate(group):
            x[i, :len(s)], mask[i, :len(s)] = s, 1
        (h,) = session.run(None, {"input_ids": x, "attention_mask": mask, "token_type_ids": np.zeros_like(x)})
        e = (h * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
        return e / np.linalg.norm(e, axis=1, keepdims=True)

    runs = []
    for size in batches:
        groups = [ids[i:i + size] for i in range(0, len(ids), size)]
        [embed(g) for g in groups]
        passes = []
        for _ in range(repeat):
            start = time.perf_counter()
            first = [embed(g) for g in groups][0][0]
            passes.append(time.perf_counter() - start)
        runs.append(Run(f"onnxruntime {onnxruntime.__version__} native (Python)", threads, size,
                        len(ids) / statistics.median(passes), first, round=round_))
    return runs


def library(out: Path) -> Path:
    """Build the kernels for QUANT alone into `out` (the tuning store's picks, as `kernelgen build`)."""
    proc = subprocess.run([sys.executable, "-m", "kernelgen.cli", "build", "--quant", QUANT, "--out", str(out),
                           "--dsl", str(ROOT / "kernels.dsl"), "--store", str(ROOT / "tuning" / "store.jsonl")],
                          capture_output=True, text=True, cwd=ROOT, timeout=BUILD_SECONDS)
    if proc.returncode:
        sys.exit(f"bench.py: kernelgen build --quant {QUANT}: exit {proc.returncode}\n{proc.stderr}")
    return out


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


@dataclass(frozen=True)
class Spread:
    """One figure over the rounds: its median, least and largest, and how many rounds gave it."""

    median: float
    low: float
    high: float
    rounds: int

    @staticmethod
    def of(values: list[float]) -> Spread:
        return Spread(statistics.median(values), min(values), max(values), len(values))

    def text(self, unit: str = "") -> str:
        if self.rounds == 1:
            return f"{self.median:.2f}{unit}"
        return f"{self.median:.2f}{unit} [{self.low:.2f}..{self.high:.2f}]"


def ratios(runs: list[Run], mine: str, peer: str, threads: int, batch: int) -> list[float]:
    """mine / peer's sentences/s in each round that timed both (at batch 1 also peer / mine's
    latency: how many times kernelgen's wait the peer's is)."""
    by = {(r.name, r.threads, r.batch, r.round): r.per_second for r in runs}
    rounds = sorted({r.round for r in runs})
    return [by[mine, threads, batch, k] / by[peer, threads, batch, k] for k in rounds
            if (mine, threads, batch, k) in by and (peer, threads, batch, k) in by]


def table(runs: list[Run], batches: list[int]) -> str:
    """The figures as rows of engine x threads, columns of batch sizes (medians over the rounds);
    ratios against onnxruntime-web where the engine ran, each within a round (median and range);
    the goals; the stage split."""
    rounds = len({r.round for r in runs})
    per: dict[tuple[str, int, int], list[Run]] = {}
    for r in runs:
        per.setdefault((r.name, r.threads, r.batch), []).append(r)
    rate = {key: statistics.median(r.per_second for r in rs) for key, rs in per.items()}
    names = list(dict.fromkeys((r.name, r.threads) for r in runs))
    native = next((r for r in runs if r.name.startswith("onnxruntime") and "native" in r.name), None)
    peers = {r.where: r.name for r in runs if r.name.startswith("onnxruntime-web")}
    cols = " ".join(f"{f'b={b}':>8}" for b in batches)
    lines = [f"{'engine':<44} {'thr':>3} {cols}  cos(first, onnxruntime)"]
    for name, t in names:
        cos = "" if native is None else f"{float(per[name, t, batches[0]][0].first @ native.first):.4f}"
        lines.append(f"{name:<44} {t:>3} " + " ".join(f"{rate[name, t, b]:8.2f}" for b in batches) + f"  {cos}")
    lines.append("\nratio: kernelgen / onnxruntime-web where both ran, same threads and batch (> 1: kernelgen faster)"
                 + (f"; each round's ratio, median [least..largest] of {rounds} rounds" if rounds > 1 else ""))
    for name, t in names:
        peer = peers.get(per[name, t, batches[0]][0].where)
        if name.startswith("kernelgen") and peer and (peer, t, batches[0]) in per:
            cells = [Spread.of(ratios(runs, name, peer, t, b)).text() for b in batches]
            width = max(8, *map(len, cells))
            lines.append(f"{name:<44} {t:>3} " + " ".join(f"{c:>{width}}" for c in cells))
    lines.append("\ngoals (issue 15)" + (f": on the median of {rounds} rounds' ratios" if rounds > 1 else ""))
    relaxed, peer = "kernelgen relaxed-simd (Chromium)", peers.get("Chromium")
    big = max(batches)
    held = lambda xs, ok: f" (held in {sum(map(ok, xs))} of {len(xs)} rounds)" if len(xs) > 1 else ""  # noqa: E731
    if peer and (relaxed, 2, big) in per and (peer, 2, big) in per:
        xs = ratios(runs, relaxed, peer, 2, big)
        r = Spread.of(xs)
        lines.append(f"  Chromium relaxed-simd 2 threads b={big}: {r.text('x')} onnxruntime-web (goal >= {GOAL_SPEEDUP}): "
                     f"{'met' if r.median >= GOAL_SPEEDUP else 'NOT met'}{held(xs, lambda x: x >= GOAL_SPEEDUP)}")
    for t in sorted({t for _, t in names}):
        if peer and (relaxed, t, 1) in per and (peer, t, 1) in per:
            mine, theirs = 1000 / rate[relaxed, t, 1], 1000 / rate[peer, t, 1]
            xs = ratios(runs, relaxed, peer, t, 1)  # > 1: kernelgen's batch of one takes less time
            r = Spread.of(xs)
            lines.append(f"  Chromium relaxed-simd {t} thread(s) b=1 latency: {mine:.1f} ms vs onnxruntime-web "
                         f"{theirs:.1f} ms, onnxruntime-web's / kernelgen's {r.text()} (goal: no worse): "
                         f"{'met' if r.median >= 1 else 'NOT met'}{held(xs, lambda x: x >= 1)}")
    lines.append("\nkernelgen's time by stage (share of embed time over every round; rest = LayerNorm, GELU, pooling)")
    for name, t in names:
        for b in batches:
            stages = [r.stage_ms for r in per[name, t, b] if r.stage_ms]
            if stages:
                s = {k: sum(st[k] for st in stages) for k in stages[0]}
                total = sum(s.values())
                lines.append(f"{name:<44} {t:>3} b={b:<3} linear {s['linear'] / total:6.1%}  attention "
                             f"{s['attention'] / total:6.1%}  rest {s['norm'] / total:6.1%}")
    return "\n".join(lines)


def _positives(text: str) -> str:
    """An argument that is a comma-separated list of positive integers, kept as text (bench.mjs
    takes it so)."""
    try:
        ok = all(int(v) >= 1 for v in text.split(","))
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"positive integers separated by commas, got {text!r}")
    return text


def _places(text: str) -> str:
    if not set(text.split(",")) <= set(WHERE):
        raise argparse.ArgumentTypeError(f"some of {', '.join(WHERE)} separated by commas, got {text!r}")
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sentences", type=positive_int, default=32, help="the first N sentences of the corpus")
    ap.add_argument("--batches", type=_positives, default="1,8,32")
    ap.add_argument("--threads", type=_positives, default="1,2")
    ap.add_argument("--repeat", type=positive_int, default=3, help="timed passes per figure (the median is kept)")
    ap.add_argument("--rounds", type=positive_int, default=3,
                    help="sweeps of every engine, taking turns (ratios are taken within a round)")
    ap.add_argument("--where", type=_places, default="node,chromium", help=f"where the JS engines run: {', '.join(WHERE)}")
    ap.add_argument("--lib", type=Path, help="a kernelgen build's directory (default: a Q8_0 build made for this run)")
    args = ap.parse_args()
    node = shutil.which("node")
    if node is None:
        sys.exit("bench.py: node is not installed")
    batches = [int(b) for b in args.batches.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    where = args.where.split(",")
    sentences = inputs.corpus()[0][:args.sentences]
    tok = inputs.tokenize(sentences)
    ids = [row[:n].tolist() for row, n in zip(tok.ids, tok.lengths)]
    load = os.getloadavg()
    runs: list[Run] = []
    with tempfile.TemporaryDirectory() as tmp:
        model, ids_file = Path(tmp) / "minilm-q8_0.safetensors", Path(tmp) / "ids.json"
        export.export(model, QUANT)
        ids_file.write_text(json.dumps(ids))
        lib = args.lib or library(Path(tmp) / "lib")
        common = [str(ids_file), "--batches", args.batches, "--repeat", str(args.repeat)]
        engines = [[*common, "--engine", "kernelgen", "--model", str(model), "--lib", str(lib), "--target", target]
                   for target in TARGETS]
        engines.append([*common, "--engine", "ort", "--onnx", str(inputs.onnx_path())])
        for k in range(args.rounds):
            for t in threads:
                for place in where:
                    for engine in (engines if k % 2 == 0 else engines[::-1]):  # turns: neither always goes first
                        runs += node_runs(node, [*engine, "--threads", str(t), *WHERE[place]], k)
                runs += onnxruntime_runs(ids, batches, t, args.repeat, k)
    node_version = subprocess.run([node, "--version"], capture_output=True, text=True).stdout.strip()
    print(f"all-MiniLM-L6-v2, {len(ids)} corpus sentences ({min(map(len, ids))}..{max(map(len, ids))} tokens, "
          f"mean {np.mean([len(s) for s in ids]):.1f}), sentences/s, the median of {args.repeat} timed passes after "
          f"an untimed one, {args.rounds} round(s) of every engine taking turns; kernelgen Q8_0 on {'the build in ' + str(args.lib) if args.lib else 'a Q8_0 build'}\n{cpu_name()}, {os.cpu_count()} CPUs, load average {load[0]:.1f} at the "
          f"start, {os.getloadavg()[0]:.1f} at the end; node {node_version}\n")
    print(table(runs, batches))


if __name__ == "__main__":
    main()

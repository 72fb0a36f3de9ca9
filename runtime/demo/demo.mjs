// The demo page: load the kernels (driver and pool in workers), show what was chosen, and time
// each kernel on one thread and through the pool; then, for a .gguf file the user picks, every
// tensor's mat-vec. ?threads=N and ?target=simd128 override the defaults. The page publishes its
// state as window.kernelgenDemo for runtime/test/browser.test.mjs.

import { loadGguf, loadKernels } from '../kernelgen.mjs';
import { random } from '../testing/random.mjs';

const MIN_MS = 250; // time each measurement for about this long
const params = new URLSearchParams(location.search);
const $ = (id) => document.getElementById(id);

const normals = (rand, n) => Float32Array.from({ length: n }, () => (rand() / 2 ** 32 - 0.5) * 6);

/** Stored blocks of a quant type with small f16 scales and random values (GGUF Q8_0 / Q4_0 here). */
function randomBlocks(spec, nblocks, rand) {
  const bytes = Uint8Array.from({ length: nblocks * spec.stored_bytes }, () => rand() & 0xff);
  const view = new DataView(bytes.buffer);
  for (let b = 0; b < nblocks; b++) {
    for (const f of spec.fields.filter((f) => f.type === 'f16')) view.setUint16(b * spec.stored_bytes + f.offset, 0x2000 | (rand() & 0x3ff), true);
  }
  return bytes;
}

function showInfo(k) {
  const i = k.info;
  const dot = i.relaxedDot;
  const probe = !dot.supported ? 'no relaxed SIMD'
    : `7-bit operand with its top bit set reads as ${dot.sevenBit}${dot.saturates === null ? '' : dot.saturates ? ', saturating (pmaddubsw)' : ', not saturating'}`
      + (dot.usable ? '' : `; not used: ${dot.note}`);
  const rows = {
    target: `${i.target} (${i.targetReason})`,
    'relaxed dot probe': probe,
    'cross-origin isolated': String(i.crossOriginIsolated),
    threads: `${i.threads}: the driver worker${i.threads > 1 ? ` and ${i.threads - 1} helper worker${i.threads > 2 ? 's' : ''}` : ''}`,
    notes: i.notes.join('; ') || '—',
    build: `kernelgen ${i.kernelgen}, inputs ${i.inputsSha256.slice(0, 12)}`,
  };
  $('info').replaceChildren(...Object.entries(rows).flatMap(([name, value]) => {
    const dt = document.createElement('dt');
    const dd = document.createElement('dd');
    dt.textContent = name;
    dd.textContent = value;
    dd.dataset.key = name;
    return [dt, dd];
  }));
  $('threads-head').textContent = i.threads > 1 ? `${i.threads} threads` : 'threaded';
}

/** The benchmarks: [kernel, size, method, args, has a pool job] with the data made once. */
async function benchmarks(k) {
  const rand = random(1);
  const n = 1024;
  const list = [];
  for (const [quant, rows, cols] of [['q8_0', n, n], ['q4_0', n, n], ['q8_0', 4 * n, 4 * n]]) {
    const spec = k.manifest.quants[quant];
    const w = await k.pack(quant, randomBlocks(spec, rows * cols / spec.block, rand), rows, cols);
    const act = await k.quantizeAct(normals(rand, cols));
    list.push([`${quant.toUpperCase()} mat-vec`, `${rows}×${cols}`, 'qmatvec', [w, act], true]);
  }
  const scores = normals(rand, 32 * n);
  const x = normals(rand, 65536);
  list.push(['softmax', `32 rows × ${n}`, 'softmax', [scores, n, n], true]);
  list.push(['SiLU', '65,536', 'silu', [x], true]);
  list.push(['SwiGLU', '65,536', 'swiglu', [x, normals(rand, 65536)], true]);
  list.push(['exp', '65,536', 'exp', [x], false]);
  list.push(['quantize activations', '4,096', 'quantizeAct', [normals(rand, 4096)], false]);
  return list;
}

function sameBits(a, b) {
  const x = new Uint8Array(a.buffer, a.byteOffset, a.byteLength);
  const y = new Uint8Array(b.buffer, b.byteOffset, b.byteLength);
  return x.length === y.length && x.every((v, i) => v === y[i]);
}

async function runAll(k, list, results) {
  const body = $('bench').tBodies[0];
  body.replaceChildren();
  results.length = 0;
  for (const [name, size, method, args, hasJob] of list) {
    const threaded = hasJob && k.info.threads > 1;
    const tr = body.insertRow();
    const cells = [name, size, '…', threaded ? '…' : '—', '', ''].map((text) => {
      const td = tr.insertCell();
      td.textContent = text;
      return td;
    });
    const one = await k.bench(method, args, { minMs: MIN_MS });
    cells[2].textContent = one.msPerCall.toFixed(3);
    const row = { name, size, method, oneMs: one.msPerCall, threadedMs: null, speedup: null, sameBits: null };
    if (one.stopped) break;
    if (threaded) {
      const many = await k.bench(method, [...args, { threads: true }], { minMs: MIN_MS });
      if (many.stopped) break;
      const same = sameBits(await k[method](...args), await k[method](...args, { threads: true }));
      Object.assign(row, { threadedMs: many.msPerCall, speedup: one.msPerCall / many.msPerCall, sameBits: same });
      cells[3].textContent = many.msPerCall.toFixed(3);
      cells[4].textContent = `${row.speedup.toFixed(2)}×`;
      cells[5].textContent = same ? '✓' : '✗ differs';
      cells[5].className = same ? 'ok' : 'bad';
    }
    results.push(row);
  }
}

/** Load the .gguf file `file` (a File), list its tensors and time each quantized one's mat-vec;
 * `model` ({file, tensors, error}) follows along. The packed weights are freed at the end. */
async function runModel(k, file, model) {
  const body = $('model').tBodies[0];
  body.replaceChildren();
  Object.assign(model, { file: file.name, tensors: [], error: null });
  document.body.dataset.model = 'running';
  $('gguf').disabled = true; // one file at a time
  $('gguf-status').textContent = `reading ${file.name}…`;
  let tensors = new Map();
  try {
    const onProgress = ({ done, tensors: n, bytes, totalBytes }) => {
      $('gguf-status').textContent = `reading ${file.name}: ${done} of ${n} tensors, ${Math.round(100 * bytes / totalBytes)}% of the bytes`;
    };
    ({ tensors } = await loadGguf(k, file, { onProgress }));
    const rand = random(2);
    const acts = new Map(); // activations per row length
    for (const [name, t] of tensors) {
      const shape = t.quant ? [t.rows, t.k] : t.shape;
      const row = { name, type: t.quant?.toUpperCase() ?? t.type, shape, ms: null };
      const tr = body.insertRow();
      const cells = [name, row.type, shape.join('×'), '—', '—'].map((text) => Object.assign(tr.insertCell(), { textContent: text }));
      if (t.quant) {
        if (!acts.has(t.k)) acts.set(t.k, await k.quantizeAct(normals(rand, t.k)));
        const { msPerCall } = await k.bench('qmatvec', [t, acts.get(t.k)], { minMs: MIN_MS / 5 });
        row.ms = msPerCall;
        cells[3].textContent = msPerCall.toFixed(3);
        cells[4].textContent = (t.rows * t.k / msPerCall / 1e6).toFixed(1);
      }
      model.tensors.push(row);
    }
    $('gguf-status').textContent = `${file.name}: ${tensors.size} tensors`;
    document.body.dataset.model = 'done';
  } catch (e) {
    model.error = `${e.name}: ${e.message}`;
    $('gguf-status').textContent = model.error;
    $('gguf-status').className = 'bad';
    document.body.dataset.model = 'failed';
  } finally {
    for (const t of tensors.values()) if (t.quant) await k.free(t);
    $('gguf').disabled = false;
  }
}

async function main() {
  const state = { info: null, results: [], error: null, model: {} };
  window.kernelgenDemo = state;
  try {
    const threads = params.has('threads') ? Number(params.get('threads')) : undefined;
    const k = await loadKernels({ threads, target: params.get('target') ?? undefined });
    state.info = k.info;
    showInfo(k);
    const list = await benchmarks(k);
    const run = async () => {
      $('run').disabled = true;
      $('stop').disabled = !k.stopFlag;
      $('status').textContent = 'running…';
      document.body.dataset.state = 'running';
      await runAll(k, list, state.results);
      $('status').textContent = `done in ${navigator.userAgent.match(/(HeadlessChrome|Chrome|Firefox|Safari)\/[\d.]+/)?.[0] ?? 'this browser'}`;
      $('run').disabled = false;
      $('stop').disabled = true;
      document.body.dataset.state = 'done';
    };
    $('run').onclick = run;
    $('stop').onclick = () => k.stop();
    $('gguf').disabled = false;
    $('gguf').onchange = (e) => {
      $('gguf-status').className = '';
      if (e.target.files[0]) runModel(k, e.target.files[0], state.model);
    };
    window.addEventListener('pagehide', () => k.terminate());
    await run();
  } catch (e) {
    state.error = `${e.name}: ${e.message}`;
    $('info').replaceChildren(Object.assign(document.createElement('dd'), { textContent: state.error, className: 'bad' }));
    document.body.dataset.state = 'failed';
  }
}

main();

// Time sentence embeddings in Node: kernelgen's JS model (minilm.mjs) or the peer, onnxruntime-web's
// wasm backend on the int8 ONNX model. bench.py runs this once per engine, target and thread count
// and prints the table; run alone:
//
//   node --experimental-wasm-relaxed-simd --no-liftoff examples/minilm/bench.mjs IDS.json \
//        --engine kernelgen --model MODEL.safetensors [--target T] [--threads N] [--batches 1,8,32]
//   node examples/minilm/bench.mjs IDS.json --engine ort --onnx model.onnx [--threads N] [--batches 1,8]
//
// IDS.json: [[101, ..., 102], ...] token ids per sentence. For each batch size B the sentences are
// embedded in batches of B, each batch padded to its longest sentence for onnxruntime-web (kernelgen
// computes only real tokens): one untimed pass (engines compile hot code again, optimized, and
// onnxruntime-web plans each new shape), then --repeat timed passes of which the fastest is kept
// (the machine is shared). Prints one JSON line per batch size:
// {engine, target, threads, batch, sentences, seconds, sentencesPerSecond, stageMs, first}, `first`
// the first sentence's embedding (so the caller can check that both engines computed the model).

import { readFile } from 'node:fs/promises';
import { parseArgs } from 'node:util';

import { loadKernels } from '../../runtime/kernelgen.mjs';
import { MiniLM } from './minilm.mjs';

const { values, positionals } = parseArgs({
  allowPositionals: true,
  options: {
    engine: { type: 'string' }, model: { type: 'string' }, onnx: { type: 'string' }, target: { type: 'string' },
    threads: { type: 'string', default: '1' }, batches: { type: 'string', default: '1,8,32' },
    repeat: { type: 'string', default: '2' },
  },
});
const fail = (message) => {
  console.error(`bench.mjs: ${message}`);
  process.exit(2);
};
const threads = Number(values.threads);
const batches = values.batches.split(',').map(Number);
const repeat = Number(values.repeat);
if (positionals.length !== 1) fail('usage: bench.mjs IDS.json --engine kernelgen|ort ... (see the file\'s head)');
if (!Number.isInteger(threads) || threads < 1) fail(`--threads must be a positive integer, got ${values.threads}`);
if (batches.some((b) => !Number.isInteger(b) || b < 1)) fail(`--batches must be positive integers, got ${values.batches}`);
if (!Number.isInteger(repeat) || repeat < 1) fail(`--repeat must be a positive integer, got ${values.repeat}`);
const sentences = JSON.parse(await readFile(positionals[0], 'utf8'));

/** mean over the mask's tokens of hidden[batch, T, n], then unit length (the model's pooling). */
function poolAndNormalize(hidden, lengths, T, n) {
  const out = new Float32Array(lengths.length * n);
  lengths.forEach((length, s) => {
    const v = new Float64Array(n);
    for (let t = 0; t < length; t++) for (let c = 0; c < n; c++) v[c] += hidden[(s * T + t) * n + c];
    const norm = Math.hypot(...v);
    for (let c = 0; c < n; c++) out[s * n + c] = v[c] / norm;
  });
  return out;
}

/** The engine: {embed(batch of id arrays) -> Float32Array, stageMs(), close()}. */
async function kernelgen() {
  if (!values.model) fail('--engine kernelgen needs --model (export.py\'s file)');
  const k = await loadKernels({ target: values.target, threads });
  const model = await MiniLM.load(k, new Uint8Array(await readFile(values.model)));
  const opts = { threads: threads > 1 };
  return {
    target: k.info.target,
    embed: (batch) => model.embed(batch, opts),
    stageMs: () => {
      const split = { ...model.stageMs };
      for (const s of Object.keys(model.stageMs)) model.stageMs[s] = 0;
      return split;
    },
    close: () => k.terminate(),
  };
}

async function onnxruntimeWeb() {
  if (!values.onnx) fail('--engine ort needs --onnx (the int8 model.onnx)');
  const ort = await import('onnxruntime-web');
  ort.env.wasm.numThreads = threads;
  const session = await ort.InferenceSession.create(new Uint8Array(await readFile(values.onnx)), { executionProviders: ['wasm'] });
  return {
    target: `onnxruntime-web ${ort.env.versions?.web ?? ''}`.trim(),
    async embed(batch) {
      const T = Math.max(...batch.map((ids) => ids.length));
      const ids = new BigInt64Array(batch.length * T);
      const mask = new BigInt64Array(batch.length * T);
      batch.forEach((s, i) => s.forEach((id, t) => {
        ids[i * T + t] = BigInt(id);
        mask[i * T + t] = 1n;
      }));
      const shape = [batch.length, T];
      const result = await session.run({
        input_ids: new ort.Tensor('int64', ids, shape), attention_mask: new ort.Tensor('int64', mask, shape),
        token_type_ids: new ort.Tensor('int64', new BigInt64Array(batch.length * T), shape),
      });
      const hidden = result[session.outputNames[0]];
      return poolAndNormalize(hidden.data, batch.map((s) => s.length), T, hidden.dims[2]);
    },
    stageMs: () => null,
    close: () => session.release(),
  };
}

const engines = { kernelgen, ort: onnxruntimeWeb };
if (!(values.engine in engines)) fail(`--engine must be one of ${Object.keys(engines).join(', ')}, got ${values.engine}`);
const engine = await engines[values.engine]();
try {
  for (const size of batches) {
    const groups = [];
    for (let i = 0; i < sentences.length; i += size) groups.push(sentences.slice(i, i + size));
    const pass = async () => {
      let first = null;
      const start = performance.now();
      for (const g of groups) {
        const e = await engine.embed(g);
        first ??= Array.from(e.subarray(0, e.length / g.length));
      }
      return { seconds: (performance.now() - start) / 1000, stageMs: engine.stageMs(), first };
    };
    await pass();
    let best = null;
    for (let r = 0; r < repeat; r++) {
      const p = await pass();
      if (!best || p.seconds < best.seconds) best = p;
    }
    console.log(JSON.stringify({
      engine: values.engine, target: engine.target, threads, batch: size, sentences: sentences.length,
      sentencesPerSecond: sentences.length / best.seconds, ...best,
    }));
  }
} finally {
  await engine.close();
}

// The benchmark's engines and its timing loop, the same code in Node and in a browser page (bench.mjs
// runs it in either): kernelgen's JS model (minilm.mjs) and the peer, onnxruntime-web's wasm backend
// on the int8 ONNX model. Each gets its modules and bytes from the caller, so nothing here knows
// where it runs.

import { MiniLM } from './minilm.mjs';

/** Mean over each sentence's tokens of hidden[batch, T, n], then unit length (the model's pooling). */
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

/** kernelgen: `loadKernels` of runtime/kernelgen.mjs, `modelBytes` export.py's file. An engine is
 * {name, threads, embed(batch of id arrays) -> Float32Array, stageMs() (and reset), close()}. */
export async function kernelgenEngine(loadKernels, modelBytes, { target, threads }) {
  const k = await loadKernels({ target, threads });
  if (k.info.threads !== threads) {
    await k.terminate();
    throw new Error(`kernelgen: ${threads} threads asked, the pool has ${k.info.threads} (${k.info.notes.join('; ')})`);
  }
  const model = await MiniLM.load(k, modelBytes);
  const opts = { threads: threads > 1 };
  return {
    name: `kernelgen ${k.info.target}`,
    threads,
    embed: (batch) => model.embed(batch, opts),
    stageMs: () => {
      const split = { ...model.stageMs };
      for (const s of Object.keys(model.stageMs)) model.stageMs[s] = 0;
      return split;
    },
    close: () => k.terminate(),
  };
}

/** onnxruntime-web: `ort` its module (Node's or the browser's build), `onnxBytes` the int8 model. Each
 * batch is padded to its longest sentence, with the attention mask. */
export async function ortEngine(ort, onnxBytes, { threads }) {
  ort.env.wasm.numThreads = threads;
  const session = await ort.InferenceSession.create(onnxBytes, { executionProviders: ['wasm'] });
  return {
    name: ['onnxruntime-web', ort.env.versions?.web, 'wasm'].filter(Boolean).join(' '),
    threads,
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

const median = (xs) => {
  const s = [...xs].sort((a, b) => a - b);
  return s.length % 2 ? s[(s.length - 1) / 2] : (s[s.length / 2 - 1] + s[s.length / 2]) / 2;
};

/** For each batch size B: `sentences` (token id arrays) embedded in batches of B, one untimed pass
 * (engines compile hot code again, optimized; onnxruntime-web plans each new shape), then `repeat`
 * timed passes. One record per batch size: {engine, threads, batch, sentences, seconds (the median
 * pass), passes (every pass's seconds), sentencesPerSecond, stageMs (summed over the timed passes,
 * null for the peer), first (the first sentence's embedding, to check the engine computed the model)}. */
export async function timeEngine(engine, sentences, batches, repeat) {
  const records = [];
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
      return { seconds: (performance.now() - start) / 1000, first };
    };
    await pass();
    engine.stageMs();
    const passes = [];
    let first = null;
    for (let r = 0; r < repeat; r++) {
      const p = await pass();
      passes.push(p.seconds);
      first = p.first;
    }
    const seconds = median(passes);
    records.push({
      engine: engine.name, threads: engine.threads, batch: size, sentences: sentences.length, seconds, passes,
      sentencesPerSecond: sentences.length / seconds, stageMs: engine.stageMs(), first,
    });
  }
  return records;
}

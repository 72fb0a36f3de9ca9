// all-MiniLM-L6-v2 sentence embeddings on kernelgen's JS runtime (runtime/kernelgen.mjs): the same
// computation as minilm.py, call for call, so Node, browsers and wasmtime give the same bits.
//
//   import { loadKernels } from '../../runtime/kernelgen.mjs';
//   import { MiniLM } from './minilm.mjs';
//   const k = await loadKernels({ threads: 2 });
//   const model = await MiniLM.load(k, bytes);                     // export.py's safetensors file
//   const e = await model.embed([[101, 7592, 102], ...], { threads: true });  // Float32Array(n * 384)
//
// The weights come from export.py (minilm.prepare's tensors: the linear layers as stored quant
// blocks, packed here into the module's memory). Token ids come from the host (Python's
// `tokenizers` on the model's tokenizer.json): there is no tokenizer in JS.

/** A safetensors file (8-byte little-endian header length, JSON header, raw little-endian data) ->
 * {metadata, tensors: {name: {dtype, shape, data}}}, data a copy as a typed array of its dtype. */
export function readSafetensors(bytes) {
  if (!(bytes instanceof Uint8Array)) throw new TypeError('readSafetensors: expected a Uint8Array');
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const headerBytes = bytes.length >= 8 ? Number(view.getBigUint64(0, true)) : -1;
  if (headerBytes < 2 || 8 + headerBytes > bytes.length) throw new RangeError('readSafetensors: not a safetensors file (bad header length)');
  const header = JSON.parse(new TextDecoder().decode(bytes.subarray(8, 8 + headerBytes)));
  const arrays = { F32: Float32Array, I32: Int32Array, U8: Uint8Array };
  const tensors = {};
  for (const [name, t] of Object.entries(header)) {
    if (name === '__metadata__') continue;
    const Array = arrays[t.dtype];
    if (!Array) throw new TypeError(`readSafetensors: ${name} has dtype ${t.dtype}; this reader takes ${Object.keys(arrays).join(', ')}`);
    const [start, end] = t.data_offsets.map((o) => 8 + headerBytes + o);
    const count = t.shape.reduce((a, b) => a * b, 1);
    if (end > bytes.length || end - start !== count * Array.BYTES_PER_ELEMENT) {
      throw new RangeError(`readSafetensors: ${name}'s data (${start}..${end}) does not hold shape [${t.shape}] of ${t.dtype}`);
    }
    // A copy: aligned for its type, and on its own buffer (cloned alone through postMessage).
    tensors[name] = { dtype: t.dtype, shape: t.shape, data: new Array(bytes.slice(start, end).buffer) };
  }
  return { metadata: header.__metadata__ ?? {}, tensors };
}

/** Per-stage wall time (ms) of the calls embed() makes: linear layers (activations quantized, the
 * product, the QKV bias), attention, and the rest (LayerNorms with their bias and residual, GELU
 * with its bias, pooling). */
const STAGES = ['linear', 'attention', 'norm'];

/** The figures embed() needs from the file's metadata (export.py writes them): the config's and
 * min_pool_tokens, the batch size below which LayerNorm, GELU and attention run on the calling
 * thread alone (minilm.py's MIN_POOL_TOKENS says why). A missing or non-numeric one is refused. */
export function settings(metadata) {
  const number = (key) => {
    const value = Number(metadata[key]);
    if (!(key in metadata) || !Number.isFinite(value)) throw new RangeError(`MiniLM: the file's metadata has no number ${key} (re-export it with export.py)`);
    return value;
  };
  return {
    hidden: number('hidden_size'), heads: number('num_attention_heads'), layers: number('num_hidden_layers'),
    eps: number('layer_norm_eps'), minPoolTokens: number('min_pool_tokens'),
  };
}

/** Each linear layer's quant type ("{layer}.{linear}" -> type) from the file's metadata (export.py
 * writes it: one type for all, or a mix such as Q4_K_M's). A file without it is refused. */
export function linearTypes(metadata) {
  let types;
  try {
    types = JSON.parse(metadata.types);
  } catch {
    throw new RangeError('MiniLM: the file\'s metadata has no linear layer types (re-export it with export.py)');
  }
  if (types === null || typeof types !== 'object' || !Object.values(types).every((t) => typeof t === 'string')) {
    throw new RangeError('MiniLM: the file\'s linear layer types are not a map of names to quant types (re-export it with export.py)');
  }
  return types;
}

export class MiniLM {
  /** Pack export.py's file (a Uint8Array) into kernels `k`. */
  static async load(k, bytes) {
    const { metadata, tensors } = readSafetensors(bytes);
    const { layers: count, ...figures } = settings(metadata);
    const types = linearTypes(metadata);
    const get = (name) => {
      if (!(name in tensors)) throw new RangeError(`MiniLM: the file has no tensor ${name}`);
      return tensors[name];
    };
    const f32 = (name) => get(name).data;
    // The layers' vectors are held in the module's memory, as the weights are: no copy per call.
    const held = (name) => k.hold(f32(name));
    const linear = async (name) => {
      const { shape: [rows, bytesPerRow], data } = get(`${name}.w`);
      if (!(name in types)) throw new RangeError(`MiniLM: the file's metadata gives no quant type for ${name}`);
      const quant = types[name];
      const spec = k.manifest.quants[quant];
      if (!spec) throw new RangeError(`MiniLM: the file's ${name} is ${quant}, which is not in this build`);
      return { w: await k.pack(quant, data, rows, (bytesPerRow / spec.stored_bytes) * spec.block), b: await held(`${name}.b`) };
    };
    const norm = async (name) => [await held(`${name}.gamma`), await held(`${name}.beta`)];
    const layers = [];
    for (let i = 0; i < count; i++) {
      layers.push({ qkv: await linear(`${i}.qkv`), out: await linear(`${i}.out`), ln1: await norm(`${i}.ln1`),
        ffn1: await linear(`${i}.ffn1`), ffn2: await linear(`${i}.ffn2`), ln2: await norm(`${i}.ln2`) });
    }
    return new MiniLM(k, {
      ...figures, word: f32('word'), pos: f32('pos'), type0: await held('type0'), ln0: await norm('ln0'), layers, order: get('order').data,
    });
  }

  constructor(k, model) {
    this.k = k;
    Object.assign(this, model);
    this.stageMs = Object.fromEntries(STAGES.map((s) => [s, 0]));
  }

  async #timed(stage, fn) {
    const start = performance.now();
    try {
      return await fn();
    } finally {
      this.stageMs[stage] += performance.now() - start;
    }
  }

  /** x[rows * in] -> x W^T (+ b with `bias`; else the next kernel adds it), quantized and multiplied in one call. */
  #project({ w, b }, x, opts, bias = false) {
    return this.#timed('linear', () => this.k.linear(w, x, bias ? b : null, opts));
  }

  /** Attention of every sentence of the batch in one call: qkv[rows * 3 * hidden] (biases added) ->
   * context [rows * hidden]. */
  #attention(qkv, lengths, opts) {
    return this.#timed('attention', () => this.k.attention(qkv, lengths, this.heads, opts));
  }

  /** Unit-length embeddings of sentences given as token id arrays ([CLS] ... [SEP]) ->
   * Float32Array(sentences * hidden). opts: {threads: true} runs the threaded kernels through the pool. */
  async embed(sentences, opts = {}) {
    const { k, hidden: n, eps } = this;
    const maxPos = this.pos.length / n;
    const vocab = this.word.length / n;
    if (!Array.isArray(sentences) || sentences.length === 0) throw new TypeError('embed: expected a non-empty array of token id arrays');
    for (const ids of sentences) {
      if (ids.length < 1 || ids.length > maxPos || Array.prototype.some.call(ids, (t) => !Number.isInteger(t) || t < 0 || t >= vocab)) {
        throw new RangeError(`embed: each sentence needs 1..${maxPos} token ids in 0..${vocab - 1}`);
      }
    }
    const lengths = sentences.map((ids) => ids.length);
    const rows = lengths.reduce((a, b) => a + b, 0);
    // Only real tokens are computed: rows of all sentences one after another.
    let x = new Float32Array(rows * n);
    const positions = new Float32Array(rows * n);
    let r = 0;
    for (const ids of sentences) {
      for (let t = 0; t < ids.length; t++, r++) {
        x.set(this.word.subarray(ids[t] * n, (ids[t] + 1) * n), r * n);
        positions.set(this.pos.subarray(t * n, (t + 1) * n), r * n);
      }
    }
    const norm = (fn) => this.#timed('norm', fn);
    // Every intermediate stays held in the module's memory (a copy in and out per kernel cost more
    // than the kernels at a few tokens); `done` frees what the next step no longer reads.
    const hold = { ...opts, hold: true };
    const rowHold = rows < this.minPoolTokens ? { hold: true } : hold;
    const live = new Set();
    const kept = async (value) => {
      const h = await value;
      live.add(h);
      return h;
    };
    const done = async (...held) => {
      for (const h of held) {
        live.delete(h);
        await k.free(h);
      }
    };
    try {
      let h = await kept(norm(() => k.layerNorm(x, ...this.ln0, positions, this.type0, eps, rowHold)));
      for (const L of this.layers) {
        const qkv = await kept(this.#project(L.qkv, h, hold, true));
        const ctx = await kept(this.#attention(qkv, lengths, rowHold));
        await done(qkv);
        const o = await kept(this.#project(L.out, ctx, hold));
        await done(ctx);
        const h1 = await kept(norm(() => k.layerNorm(o, ...L.ln1, h, L.out.b, eps, rowHold)));
        await done(o, h);
        const f1 = await kept(this.#project(L.ffn1, h1, hold));
        const f = await kept(norm(() => k.gelu(f1, L.ffn1.b, rowHold)));
        await done(f1);
        const f2 = await kept(this.#project(L.ffn2, f, hold));
        await done(f);
        h = await kept(norm(() => k.layerNorm(f2, ...L.ln2, h1, L.ffn2.b, eps, rowHold)));
        await done(f2, h1);
      }
      x = await k.read(h);
    } finally {
      await done(...live);
    }
    // Pooling over the batch padded to its longest sentence, as the Python host pads it.
    const T = Math.max(...lengths);
    const padded = new Float32Array(sentences.length * T * n);
    const mask = new Float32Array(sentences.length * T);
    let row = 0;
    lengths.forEach((length, s) => {
      padded.set(x.subarray(row * n, (row + length) * n), s * T * n);
      mask.fill(1, s * T, s * T + length);
      row += length;
    });
    const pooled = await norm(() => k.meanPool(padded, mask, sentences.length));
    const e = await norm(() => k.l2Normalize(pooled, n));
    // The file's hidden channels are in minilm.py's channel_order: put them back in the model's.
    const out = new Float32Array(e.length);
    for (let s = 0; s < sentences.length; s++) for (let j = 0; j < n; j++) out[s * n + this.order[j]] = e[s * n + j];
    return out;
  }
}

/** Load kernels (`loadKernels` of runtime/kernelgen.mjs, wherever it is served from) with {target,
 * threads}, pack the model from export.py's `bytes`, embed `sentences` (threaded when threads > 1)
 * and let the kernels go. Refuses a pool smaller than asked (a page that is not cross-origin
 * isolated gets one thread). */
export async function embedOnce(loadKernels, bytes, sentences, { target, threads = 1 } = {}) {
  const k = await loadKernels({ target, threads });
  try {
    if (k.info.threads !== threads) throw new Error(`${threads} threads asked, the pool has ${k.info.threads} (${k.info.notes.join('; ')})`);
    const model = await MiniLM.load(k, bytes);
    return await model.embed(sentences, { threads: threads > 1 });
  } finally {
    await k.terminate();
  }
}

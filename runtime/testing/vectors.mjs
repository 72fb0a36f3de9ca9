// Runs the test vectors that tests/test_js.py writes (inputs from numpy, outputs from wasmtime)
// through a loaded Kernels and compares bit for bit. Used by kernels.test.mjs in Node and by
// browser.test.mjs inside the page, so both check the same cases the same way.
//
// index.json: {threads, builds: {target: inputs_sha256}, arrays: {name: {file, dtype}},
//   packed: {name: {quant, blocks, rows, k}}, cases: [{name, call, args, opts?, threaded}],
//   expected: {target: {case: {output: {file, dtype}}}}}
// An argument is a literal, {array: name}, {packed: name} (pack() of those blocks) or {act: name,
// tokens?} (quantizeAct of that array as `tokens` rows). A case with opts takes them as its last
// argument, and when threaded it runs a second time with {threads: true}; a case marked held runs
// again with its Float32Array arguments held (hold()) and {hold: true}, the result read back.

import { packPlanes } from '../kernelgen.mjs';

const ARRAYS = { float32: Float32Array, float64: Float64Array, int8: Int8Array, uint8: Uint8Array, int16: Int16Array, int32: Int32Array };

/** `read(file)` -> ArrayBuffer of a file of the vectors directory. */
export async function loadArray(read, { file, dtype }) {
  const Type = ARRAYS[dtype];
  if (!Type) throw new Error(`${file}: unsupported dtype ${dtype}`);
  return new Type(await read(file));
}

/** Bit patterns of floats (any NaN matching any NaN) or integers; null when equal. */
export function firstDifference(got, want) {
  if (got?.constructor !== want.constructor) return `got ${got?.constructor?.name}, want ${want.constructor.name}`;
  if (got.length !== want.length) return `got ${got.length} values, want ${want.length}`;
  const float = got instanceof Float32Array || got instanceof Float64Array;
  const Bits = got instanceof Float32Array ? Uint32Array : got instanceof Float64Array ? BigUint64Array : got.constructor;
  const gb = new Bits(got.buffer, got.byteOffset, got.length);
  const wb = new Bits(want.buffer, want.byteOffset, want.length);
  for (let i = 0; i < got.length; i++) {
    if (gb[i] !== wb[i] && !(float && Number.isNaN(got[i]) && Number.isNaN(want[i]))) {
      return `[${i}]: got ${got[i]} (0x${gb[i].toString(16)}), want ${want[i]} (0x${wb[i].toString(16)})`;
    }
  }
  return null;
}

/** A result as named outputs: typed array -> out, number -> value (an f32), objects as they are. */
function outputs(value) {
  if (ArrayBuffer.isView(value)) return { out: value };
  if (typeof value === 'number') return { value: Float32Array.of(value) };
  return value;
}

/** kernels[call] with every Float32Array argument held and {hold: true} -> the result read back.
 * The held arguments must come out unchanged (a kernel that writes over its input's copy must not
 * write over a held input); everything held is freed. */
async function heldCall(kernels, call, args, opts) {
  const held = [];
  try {
    for (const a of args) held.push(a instanceof Float32Array ? await kernels.hold(a) : a);
    const result = await kernels[call](...held, { ...opts, hold: true });
    try {
      for (const [i, a] of args.entries()) {
        const diff = a instanceof Float32Array && firstDifference(await kernels.read(held[i]), a);
        if (diff) throw new Error(`held argument ${i} changed: ${diff}`);
      }
      return await kernels.read(result);
    } finally {
      await kernels.free(result);
    }
  } finally {
    for (const h of held) if (h?.held) await kernels.free(h);
  }
}

/** Run every case on `kernels`; -> [{name, threads, ok, detail}] (plain data, for page.evaluate). */
export async function runVectors(kernels, index, read) {
  const target = kernels.info.target;
  const want = index.expected[target];
  if (!want) throw new Error(`the vectors have no expected outputs for ${target}`);
  if (index.builds[target] !== kernels.info.inputsSha256) {
    throw new Error(`out/${target} changed since the vectors were written (inputs ${kernels.info.inputsSha256}, `
      + `vectors ${index.builds[target]}): write them again`);
  }
  const arrays = new Map();
  const array = async (name) => {
    if (!arrays.has(name)) arrays.set(name, await loadArray(read, index.arrays[name]));
    return arrays.get(name);
  };
  const made = new Map(); // packed weights and activations, made once per run
  const once = async (key, make) => {
    if (!made.has(key)) made.set(key, await make());
    return made.get(key);
  };
  const resolve = async (arg) => {
    if (arg?.array) return array(arg.array);
    if (arg?.act) {
      const tokens = arg.tokens ?? 1;
      return once(`act:${arg.act}:${tokens}`, async () => kernels.quantizeAct(await array(arg.act), tokens));
    }
    if (arg?.packed) {
      const p = index.packed[arg.packed];
      return once(`packed:${arg.packed}`, async () => kernels.pack(p.quant, await array(p.blocks), p.rows, p.k));
    }
    return arg;
  };

  const results = [];
  for (const c of index.cases) {
    const args = await Promise.all(c.args.map(resolve));
    const runs = (c.threaded ? [false, true] : [false]).flatMap((threads) => (c.held ? [false, true] : [false]).map((held) => [threads, held]));
    for (const [threads, held] of runs) {
      const name = `${target} ${c.name}${threads ? ' threaded' : ''}${held ? ' held' : ''}`;
      try {
        let value;
        if (c.call === 'packPlanes') value = packPlanes(kernels.manifest.quants[args[0]], args[1], args[2], args[3]);
        else if (held) value = await heldCall(kernels, c.call, args, { ...c.opts, threads });
        else value = await kernels[c.call](...args, ...(c.opts ? [{ ...c.opts, threads }] : []));
        const got = outputs(value);
        const problems = [];
        for (const [key, spec] of Object.entries(want[c.name])) {
          const diff = key in got ? firstDifference(got[key], await loadArray(read, spec)) : 'missing';
          if (diff) problems.push(`${key} ${diff}`);
        }
        const extra = Object.keys(got).filter((key) => !(key in want[c.name]));
        if (extra.length) problems.push(`unexpected outputs ${extra.join(', ')}`);
        results.push({ name, threads, ok: problems.length === 0, detail: problems.join('; ') });
      } catch (e) {
        results.push({ name, threads, ok: false, detail: `${e.name}: ${e.message}` });
      }
    }
  }
  return results;
}

// What the runtime checks in a manifest before it runs the wasm beside it (mirrors
// kernelgen/host/manifest.py). A manifest and its wasm are one build's output: the manifest records
// the wasm's sha256 and a wasm from another build (another target, other tune values, a
// half-replaced out/) is refused. The pool's words must lie below heap_base, where no buffer the
// runtime allocates can overwrite them.

import { readBytes } from './platform.mjs';

export const I32_MAX = 2 ** 31 - 1;
export const MAX_THREADS = 256; // POOL_GEN's low 8 bits count the helpers of a job (kernels.dsl)
const MAX_PAGES = 65536; // a 32-bit wasm memory: 4 GiB
const PAGE_BYTES = 65536;
// The words the pools read and write (runtime/pool.mjs, kernelgen/host/pool.py).
const POOL_WORDS = ['POOL_GEN', 'POOL_LEFT', 'POOL_READY', 'POOL_NEXT', 'POOL_JOB', 'POOL_COUNT', 'POOL_CHUNK',
  'POOL_WANT', 'POOL_STOP', 'JOB_ARGS'];

const isInt = (v) => Number.isInteger(v);

async function sha256Hex(bytes) {
  const digest = await globalThis.crypto.subtle.digest('SHA-256', bytes);
  return [...new Uint8Array(digest)].map((b) => b.toString(16).padStart(2, '0')).join('');
}

/** Read `dir`'s kernels.json and kernels.wasm and check that they belong together: {manifest, wasm,
 * notes}. Every problem is an Error naming the file and what is wrong. */
export async function loadBuild(dir) {
  const jsonUrl = new URL('kernels.json', dir);
  const wasmUrl = new URL('kernels.wasm', dir);
  const read = async (url) => {
    try {
      return await readBytes(url);
    } catch (e) {
      const error = new Error(`${url}: cannot read it (${e.code ?? e.message}); build it with \`kernelgen build\``);
      error.unreadable = true; // absent or not served (the driver runs the base build instead of a flavor so missing)
      throw error;
    }
  };
  const [json, wasm] = await Promise.all([read(jsonUrl), read(wasmUrl)]);
  const notes = [];
  await checkSignature(json, jsonUrl.href, notes);
  let manifest;
  try {
    manifest = JSON.parse(new TextDecoder().decode(json));
  } catch (e) {
    throw new Error(`${jsonUrl}: not a valid manifest (${e.message}); rebuild with \`kernelgen build\``);
  }
  await checkManifest(manifest, wasm, jsonUrl.href, notes);
  return { manifest, wasm, notes };
}

const SIGNED = /"manifest_sha256": "([0-9a-f]{64})"\n}\n$/;

/** Throw an Error naming `where` unless kernels.json's bytes `json` carry their own sha256: the
 * last key, manifest_sha256, is the sha256 of the text with that value written as 64 zeros
 * (kernelgen/host/manifest.py manifest_text). A manifest edited after its build would run kernels
 * under names, arguments or layouts they were not built for. */
async function checkSignature(json, where, notes) {
  const bytes = new Uint8Array(json);
  const tail = new TextDecoder().decode(bytes.subarray(Math.max(0, bytes.length - 100)));
  const m = SIGNED.exec(tail);
  if (!m) throw new Error(`${where}: not signed by its build (no manifest_sha256 at its end); rebuild with \`kernelgen build\``);
  if (!globalThis.crypto?.subtle) {
    notes.push('no crypto.subtle (not a secure context): the manifest was not checked against its own sha256');
    return;
  }
  const zeros = bytes.slice();
  zeros.fill(0x30, bytes.length - (tail.length - m.index) + '"manifest_sha256": "'.length, bytes.length - 4); // the 64 hex digits
  if (await sha256Hex(zeros) !== m[1]) {
    throw new Error(`${where}: edited after its build (its manifest_sha256 is not the sha256 of its text); rebuild with \`kernelgen build\``);
  }
}

/** Throw an Error naming `where` unless `manifest` describes `wasm`; `notes` gets what could not be checked. */
export async function checkManifest(manifest, wasm, where, notes = []) {
  const fail = (message) => new Error(`${where}: ${message}; rebuild with \`kernelgen build\``);
  if (manifest === null || typeof manifest !== 'object' || Array.isArray(manifest)) throw fail('not a kernelgen manifest (not a JSON object)');
  const missing = ['target', 'memory', 'exports', 'jobs', 'quants', 'constants', 'activation', 'wasm_sha256'].filter((k) => !(k in manifest));
  if (missing.length) throw fail(`not a kernelgen manifest of this version (no ${missing.join(', ')})`);
  if (globalThis.crypto?.subtle) {
    const digest = await sha256Hex(wasm);
    if (digest !== manifest.wasm_sha256) {
      throw fail(`the wasm does not match this manifest (its sha256 is ${digest.slice(0, 16)}..., the manifest names `
        + `${String(manifest.wasm_sha256).slice(0, 16)}...): they come from different builds`);
    }
  } else {
    notes.push('no crypto.subtle (not a secure context): the wasm was not checked against its manifest');
  }
  const mem = manifest.memory;
  const keys = ['min_pages', 'max_pages', 'heap_base', 'job_arg_words'];
  if (mem === null || typeof mem !== 'object' || !keys.every((k) => isInt(mem[k])) || typeof mem.fixed !== 'object' || mem.fixed === null) {
    throw fail(`memory must give integers ${keys.join(', ')} and the fixed addresses`);
  }
  if (!(mem.min_pages >= 1 && mem.min_pages <= mem.max_pages && mem.max_pages <= MAX_PAGES)) {
    throw fail(`memory needs 1 <= min_pages <= max_pages <= ${MAX_PAGES}, got min_pages=${mem.min_pages}, max_pages=${mem.max_pages}`);
  }
  const absent = POOL_WORDS.filter((n) => !isInt(mem.fixed[n]));
  if (absent.length) throw fail(`memory.fixed has no address for ${absent.join(', ')}`);
  const spans = Object.entries(mem.fixed)
    .map(([n, a]) => [a, a + (n === 'JOB_ARGS' ? 4 * mem.job_arg_words : 4), n])
    .sort((x, y) => x[0] - y[0]);
  spans.forEach(([a, end, n], i) => {
    const [b, , m] = spans[i + 1] ?? [mem.heap_base, 0, 'heap_base'];
    if (!isInt(a) || a <= 0 || a % 4) throw fail(`memory.fixed.${n}=${a} is not a positive multiple of 4`);
    if (end > b) throw fail(`memory.fixed.${n} (bytes ${a}..${end}) overlaps ${m} at ${b}`);
  });
  if (mem.heap_base > mem.max_pages * PAGE_BYTES) throw fail(`memory.heap_base=${mem.heap_base} is beyond max_pages=${mem.max_pages}`);
  if (!(isInt(mem.align) && mem.align >= 16 && (mem.align & (mem.align - 1)) === 0)) {
    throw fail(`memory.align must be a power of two of at least 16 (the allocator's alignment), got ${mem.align}`);
  }
  if (manifest.jobs === null || typeof manifest.jobs !== 'object') throw fail('jobs must be an object');
  for (const [name, job] of Object.entries(manifest.jobs)) {
    if (!isInt(job?.index) || !Array.isArray(job.args) || job.args.length > mem.job_arg_words) {
      throw fail(`jobs.${name} needs an index and at most ${mem.job_arg_words} args`);
    }
    const t = job.tuned;
    if (t != null && !(isInt(t.threads) && isInt(t.chunk) && t.threads >= 1 && t.threads <= MAX_THREADS && t.chunk >= 1 && t.chunk <= I32_MAX)) {
      throw fail(`jobs.${name}.tuned must give threads in 1..${MAX_THREADS} and chunk in 1..${I32_MAX}, got ${JSON.stringify(t)}`);
    }
  }
  const isObject = (v) => v !== null && typeof v === 'object' && !Array.isArray(v);
  if (!isObject(manifest.exports) || !isObject(manifest.quants)) throw fail('exports and quants must be objects');
  for (const [name, e] of Object.entries(manifest.exports)) {
    if (!(isObject(e) && typeof e.kernel === 'string' && (e.quant === null || typeof e.quant === 'string') && Array.isArray(e.params))) {
      throw fail(`exports.${name} needs a kernel name, a quant type name or null, and its params`);
    }
    const job = isObject(e.parallel) && typeof e.parallel.job === 'string' && Object.hasOwn(manifest.jobs, e.parallel.job) ? manifest.jobs[e.parallel.job] : null;
    if (e.parallel != null && !(job && typeof e.parallel.items === 'string' && job.kernel === `${e.kernel}_job` && job.quant === e.quant)) {
      throw fail(`exports.${name}.parallel must give its items and name a job of ${e.kernel}`);
    }
    if (!e.params.every((p) => isObject(p) && typeof p.name === 'string')) throw fail(`exports.${name}.params must be objects with a name`);
    const tune = e.tune ?? {};
    if (!isObject(tune) || !Object.values(tune).every(isInt) || variantName(e.kernel, e.quant, tune) !== name) {
      throw fail(`exports.${name} names kernel ${JSON.stringify(e.kernel)}, quant ${JSON.stringify(e.quant)} and tune ${JSON.stringify(tune)}, whose export is not ${JSON.stringify(name)}`);
    }
    const ints = new Set(e.params.filter((p) => p.type === 'i32' && p.dsl_type !== 'ptr').map((p) => p.name));
    const reads = new Set(e.params.filter((p) => p.dsl_type === 'ptr' && p.extent != null && !readsMemory(p.extent)).map((p) => p.name));
    for (const p of e.params) {
      const i32 = ints.has(p.name);
      if (!(p.extent == null || (p.dsl_type === 'ptr' && isFormula(p.extent, ints, reads))) || !(p.minimum == null || (i32 && isFormula(p.minimum, ints)))
          || !(p.multiple == null || (i32 && isInt(p.multiple) && p.multiple >= 1))) {
        throw fail(`exports.${name}.${p.name}: an extent (of a pointer) or minimum (of an i32) must be a formula of ${name}'s i32 parameters, `
          + 'and a multiple (of an i32) a positive integer');
      }
    }
    if (e.parallel != null && !isFormula(e.parallel.count, ints)) throw fail(`exports.${name}.parallel.count must be a formula of its i32 parameters`);
  }
  for (const [name, q] of Object.entries(manifest.quants)) {
    const planes = q?.planes;
    if (!(isObject(q) && isInt(q.block) && q.block >= 1 && isInt(q.group) && q.group >= 1 && isObject(planes)
        && Object.keys(planes).length && Object.values(planes).every((p) => isObject(p) && typeof p.dtype === 'string'
          && isInt(p.bytes_per_block) && p.bytes_per_block >= 1))) {
      throw fail(`quants.${name} must give a block, a group of rows and its planes (dtype, bytes_per_block)`);
    }
  }
  const act = manifest.activation;
  if (!(isObject(act) && ['int8', 'int16'].includes(act.dtype) && act.sums === 'int32' && typeof act.split === 'boolean' && isInt(act.max))) {
    throw fail('activation must give dtype (int8 or int16), sums (int32), split and max');
  }
  const flavors = manifest.flavors ?? {};
  if (!isObject(flavors) || !Object.values(flavors).every((f) => isObject(f) && typeof f.dir === 'string'
      && /^[A-Za-z_][A-Za-z0-9_]*$/.test(f.dir) && isObject(f.when))) {
    throw fail('flavors must map names to a directory name (dir, a plain name) and the probe outcome they suit (when)');
  }
  return notes;
}

// ---- formulas of a call's arguments: item counts, extents (as kernelgen/host/manifest.py) --------

const FORMULA_OPS = new Set(['+', '-', '*', '/', '%']);
const MAX_FORMULA_DEPTH = 32; // deeper than any the compiler writes

/** Whether `tree` is a formula of the i32 arguments `names`, reading (['i32', p, index]) only
 * pointers in `reads`, with indices that read nothing. */
function isFormula(tree, names, reads = new Set(), depth = 0) {
  if (isInt(tree)) return true;
  if (typeof tree === 'string') return names.has(tree);
  if (Array.isArray(tree) && tree.length === 3 && tree[0] === 'i32') return reads.has(tree[1]) && isFormula(tree[2], names, new Set(), depth + 1);
  return Array.isArray(tree) && tree.length === 3 && FORMULA_OPS.has(tree[0]) && depth < MAX_FORMULA_DEPTH
    && isFormula(tree[1], names, reads, depth + 1) && isFormula(tree[2], names, reads, depth + 1);
}

/** Whether a formula reads memory (['i32', p, index] in it). */
const readsMemory = (tree, depth = 0) => Array.isArray(tree) && tree.length === 3 && depth < MAX_FORMULA_DEPTH
  && (tree[0] === 'i32' || readsMemory(tree[1], depth + 1) || readsMemory(tree[2], depth + 1));

/** A manifest formula ([op, left, right], argument names, numbers) of a call's i32 arguments `env`,
 * as wasm's i32 ops compute it (an item count), or (`exact`) in whole numbers: an extent in bytes,
 * whose wrap would hide an overrun. `load(p, i)`: the i32 at index i of pointer argument p (an
 * extent's ['i32', p, i]). */
export function evaluate(tree, env, exact = false, load = null) {
  if (typeof tree === 'string') return exact ? Number(env[tree]) : env[tree] | 0;
  if (typeof tree === 'number') return tree;
  const [op, left, right] = tree;
  if (op === 'i32') {
    if (!load) throw new RangeError(`${JSON.stringify(tree)} reads memory`);
    return load(left, evaluate(right, env, exact));
  }
  const a = evaluate(left, env, exact, load);
  const b = evaluate(right, env, exact, load);
  if ((op === '/' || op === '%') && b === 0) throw new RangeError(`${JSON.stringify(tree)} divides by zero`);
  if (exact) return { '+': a + b, '-': a - b, '*': a * b, '/': Math.trunc(a / b), '%': a % b }[op];
  const ops = { '+': () => a + b, '-': () => a - b, '*': () => Math.imul(a, b), '/': () => Math.trunc(a / b), '%': () => a % b };
  return ops[op]() | 0;
}

/** The declared shape a parameter's meaning starts with (`f32[rows, k]`): to its first comma
 * outside brackets. */
export function shapeOf(param) {
  const text = String(param.meaning ?? '');
  let depth = 0;
  for (let i = 0; i < text.length; i += 1) {
    depth += (text[i] === '[') - (text[i] === ']');
    if (text[i] === ',' && depth === 0) return text.slice(0, i);
  }
  return text;
}

/** Throw a RangeError for a call of export `name` (manifest entry `spec`) its contract does not
 * allow: an i32 argument that is not the "multiple" the kernel needs or below its "minimum", or a
 * pointer whose "extent" (bytes) runs past what it points into: `sizes[i]`, the byte length of a
 * typed array the caller copies in for argument i, else the memory's `end` from its address. An
 * extent that reads another pointer's i32 (attention's rows, starts[seqs]) comes after that
 * pointer's own check and reads within it: `read(i, offset)`, the i32 at byte offset of argument i. */
export function checkArguments(name, spec, args, end, sizes = [], read = null) {
  const env = Object.create(null); // a parameter may be named __proto__
  spec.params.forEach((p, i) => {
    if (p.type === 'i32' && p.dsl_type !== 'ptr') env[p.name] = args[i];
  });
  spec.params.forEach((p, i) => {
    if (p.multiple && env[p.name] % p.multiple) throw new RangeError(`${name} ${p.name}: must be a multiple of ${p.multiple}, got ${args[i]}`);
    if (p.minimum != null) {
      const least = evaluate(p.minimum, env, true);
      const said = typeof p.minimum === 'string' ? ` (${p.minimum})` : '';
      if (env[p.name] < least) throw new RangeError(`${name} ${p.name}: must be at least ${least}${said}, got ${args[i]}`);
    }
  });
  const checked = new Map(); // pointer -> [argument index, bytes its extent was checked for]
  const load = (pointer, index) => {
    const [i, size] = checked.get(pointer);
    if (!(index >= 0 && 4 * index <= size - 4) || !read) throw new RangeError(`${name}: ${pointer}[${index}] is outside ${pointer}'s extent (${size} bytes)`);
    return read(i, 4 * index);
  };
  const order = spec.params.map((p, i) => i).sort((i, j) => readsMemory(spec.params[i].extent) - readsMemory(spec.params[j].extent));
  for (const i of order) { // those whose extents read another pointer's i32s after it
    const p = spec.params[i];
    if (p.extent == null) continue;
    const need = evaluate(p.extent, env, true, load);
    if (!Number.isFinite(need)) throw new RangeError(`${name} ${p.name} (${shapeOf(p)}): its extent is not a finite number of bytes`);
    if (sizes[i] !== undefined) {
      if (need > sizes[i]) throw new RangeError(`${name} ${p.name} (${shapeOf(p)}): needs ${need} bytes, got a typed array of ${sizes[i]}`);
    } else if (args[i] + need > end) {
      throw new RangeError(`${name} ${p.name} (${shapeOf(p)}): ${need} bytes from address ${args[i]} run past the memory's end at ${end}`);
    }
    checked.set(p.name, [i, need]);
  }
}

/** An export's name from its kernel, quant type and tune values (kernelgen/names.py variant_name). */
export function variantName(kernel, quant, tune) {
  const base = quant ? `${kernel}_${quant}` : kernel;
  const params = Object.entries(tune).map(([k, v]) => `${k}${v}`);
  return params.length ? `${base}__${params.join('_')}` : base;
}

/** Throw unless the instance `exports` a function of each manifest export's name taking its
 * parameter count (as kernelgen/host/manifest.py check_exports, which also compares the wasm
 * types: a JS function says only its length): a manifest edited after its build (its sha256
 * covers the wasm only) would run one kernel under another's name or arguments. */
export function checkExports(manifest, exports, where) {
  for (const [name, e] of Object.entries(manifest.exports)) {
    const f = exports[name];
    if (typeof f !== 'function' || f.length !== e.params.length) {
      throw new Error(`${where}: exports.${name} gives ${e.params.length} parameters, the wasm `
        + `${typeof f === 'function' ? `function takes ${f.length}` : 'has no such function'}; rebuild with \`kernelgen build\``);
    }
  }
}

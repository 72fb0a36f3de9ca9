// The few things Node and browsers do differently: reading files, workers and their messages.

export const isNode = typeof process === 'object' && process.versions?.node !== undefined;
/** Whether this thread may block (memory.atomic.wait32): Node's threads and a browser's dedicated
 * workers may, a page's main thread may not. */
export const mayBlock = isNode
  || (typeof DedicatedWorkerGlobalScope === 'function' && globalThis instanceof DedicatedWorkerGlobalScope);

const nodeWorkers = isNode ? await import('node:worker_threads') : null;
const nodeOs = isNode ? await import('node:os') : null;

/** The bytes at `url` (file: URLs in Node, anything fetch takes in a browser). */
export async function readBytes(url) {
  if (isNode && url.protocol === 'file:') {
    const { readFile } = await import('node:fs/promises');
    return new Uint8Array(await readFile(url));
  }
  const res = await fetch(url);
  if (!res.ok) throw new Error(`${url}: HTTP ${res.status}`);
  return new Uint8Array(await res.arrayBuffer());
}

export async function readJson(url) {
  return JSON.parse(new TextDecoder().decode(await readBytes(url)));
}

/** How many threads the machine can run at once. */
export function hardwareThreads() {
  return isNode ? nodeOs.availableParallelism() : navigator.hardwareConcurrency || 1;
}

/**
 * Start runtime/worker.mjs. Returns {post(message, transfer), onMessage(fn), onError(fn), onExit(fn),
 * terminate()} over a Node worker thread or a (module) Web Worker (which has no exit event: onExit
 * never calls fn). Node workers inherit execArgv, so they get the same
 * --experimental-wasm-relaxed-simd / --no-liftoff as this process.
 */
export function startWorker(name) {
  const url = new URL('./worker.mjs', import.meta.url);
  if (isNode) {
    const w = new nodeWorkers.Worker(url, { name });
    // A pool left running never keeps the process alive: unref again after each listener, which
    // refs the worker (a script that never terminated a pool of 2 threads never exited).
    const listen = (event, fn) => { w.on(event, fn); w.unref(); };
    w.unref();
    return {
      post: (msg, transfer) => w.postMessage(msg, transfer),
      onMessage: (fn) => listen('message', fn),
      onError: (fn) => listen('error', fn),
      onExit: (fn) => listen('exit', fn),
      terminate: () => w.terminate(),
    };
  }
  const w = new Worker(url, { type: 'module', name });
  return {
    post: (msg, transfer) => w.postMessage(msg, transfer),
    onMessage: (fn) => w.addEventListener('message', (e) => fn(e.data)),
    onError: (fn) => w.addEventListener('error', (e) => fn(e.error ?? new Error(e.message || `worker ${name} failed to start`))),
    onExit: () => {},
    terminate: () => w.terminate(),
  };
}

/** Inside a worker: {post, onMessage} towards the thread that started it. */
export function parentChannel() {
  if (isNode) {
    const port = nodeWorkers.parentPort;
    return { post: (msg, transfer) => port.postMessage(msg, transfer), onMessage: (fn) => port.on('message', fn) };
  }
  return {
    post: (msg, transfer) => self.postMessage(msg, transfer),
    onMessage: (fn) => self.addEventListener('message', (e) => fn(e.data)),
  };
}

// A worker of the runtime. Its first message says what it is:
//   {role: 'helper', ...}  a pool helper (runtime/pool.mjs runHelper) until the pool stops;
//   {role: 'driver', ...}  (browsers) the driver: loads the kernels, starts the helpers and runs
//                          the calls the page sends, since a page's main thread may not block.

import { API, Driver } from './driver.mjs';
import { parentChannel } from './platform.mjs';
import { runHelper } from './pool.mjs';

const parent = parentChannel();

/** An error as plain data for postMessage (runtime/kernelgen.mjs revives it). */
function errorData(e) {
  return { name: e?.name ?? 'Error', message: String(e?.message ?? e), driverError: e?.driverError, helperErrors: e?.helperErrors };
}

/** The ArrayBuffers of the typed arrays in a result, moved rather than copied to the page. */
function transferables(value) {
  const views = ArrayBuffer.isView(value) ? [value] : Object.values(value ?? {}).filter((v) => ArrayBuffer.isView(v));
  return views.map((v) => v.buffer).filter((b) => b instanceof ArrayBuffer);
}

async function helper(msg) {
  try {
    await runHelper(msg);
    parent.post({ type: 'exited' });
  } catch (e) {
    parent.post({ type: 'failed', message: String(e?.message ?? e) });
  }
}

async function driver(msg) {
  let d;
  try {
    d = await Driver.load(msg);
  } catch (e) {
    parent.post({ type: 'failed', error: errorData(e) });
    return;
  }
  parent.onMessage(async ({ id, method, args }) => {
    try {
      if (method === 'close') {
        await d.close();
        parent.post({ id, ok: true });
        return;
      }
      if (!API.includes(method)) throw new Error(`not an API method: ${method}`);
      const value = d[method](...args);
      parent.post({ id, ok: true, value }, transferables(value));
    } catch (e) {
      parent.post({ id, ok: false, error: errorData(e) });
    }
  });
  parent.post({ type: 'ready', info: d.info, manifest: d.manifest });
}

let started = false;
parent.onMessage((msg) => {
  if (started) return; // later messages belong to the driver's own handler
  started = true;
  if (msg.role === 'helper') helper(msg);
  else if (msg.role === 'driver') driver(msg);
  else parent.post({ type: 'failed', message: `unknown role ${msg.role}` });
});

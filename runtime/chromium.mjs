// Headless Chromium on a page of serve.mjs, for the Node-side tools that run the kernels in a
// browser: the tuner and the bench (kernelgen/tuning/chromium_page.mjs), the example's scripts
// (examples/minilm/chromium.mjs) and the browser tests. Debian's executable, never a downloaded
// browser, driven by playwright-core, which the caller passes in (the tuner's copy of the runtime
// may sit in an installed wheel with no node_modules beside it).

import { startServer } from './serve.mjs';

export const CHROMIUM = '/usr/bin/chromium';
export const LAUNCH_ARGS = ['--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking',
  '--disable-component-update', '--disable-sync', '--no-first-run'];

/** LAUNCH_ARGS with V8 flags for the browser (`jsFlags`, e.g. Node's --no-liftoff). */
export function launchArgs(jsFlags = []) {
  return jsFlags.length ? [...LAUNCH_ARGS, `--js-flags=${jsFlags.join(' ')}`] : LAUNCH_ARGS;
}

/**
 * Serve `mounts` ({'/prefix/': dir}) with serve.mjs (every page cross-origin isolated), open
 * `path` of the server in `chromium` and resolve to what `use(page, server, version)` resolves to
 * (`version`: "chromium <version>"). Rejects if the page threw an uncaught error; the browser and
 * the server are closed afterwards either way.
 */
export async function withPage({ playwright, chromium = CHROMIUM, mounts = {}, path = '', viewport, jsFlags = [] }, use) {
  const server = await startServer({ mounts });
  try {
    const browser = await playwright.chromium.launch({ executablePath: chromium, args: launchArgs(jsFlags) });
    try {
      const page = await browser.newPage(viewport ? { viewport } : {});
      const errors = [];
      page.on('pageerror', (e) => errors.push(e.message));
      await page.goto(`${server.url}${path}`);
      const result = await use(page, server, `chromium ${browser.version()}`);
      if (errors.length) throw new Error(`the page failed: ${errors.join('; ')}`);
      return result;
    } finally {
      await browser.close();
    }
  } finally {
    await server.close();
  }
}

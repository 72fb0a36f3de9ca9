// A cross-origin isolated page in headless Chromium (Debian's /usr/bin/chromium, driven by
// playwright-core) on runtime/serve.mjs, for the example's scripts that run the model in a browser
// (embed.mjs, bench.mjs, demo/drive.mjs).

import { dirname } from 'node:path';
import { fileURLToPath } from 'node:url';

import { startServer } from '../../runtime/serve.mjs';

const CHROMIUM = '/usr/bin/chromium';
const LAUNCH_ARGS = ['--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking',
  '--disable-component-update', '--disable-sync', '--no-first-run'];
const HERE = dirname(fileURLToPath(import.meta.url));

/**
 * Serve runtime/, out/, this directory at /minilm/ and `mounts` ({'/model/': dir}); open `path`
 * (default /minilm/, any page of the server is cross-origin isolated) and run `use(page, server)`.
 * `jsFlags`: V8 flags for the browser (the benchmark passes Node's --no-liftoff).
 * Resolves to what `use` resolves to; rejects if the page threw an uncaught error. Everything is
 * closed afterwards.
 */
export async function withPage({ mounts = {}, path = 'minilm/', viewport, jsFlags = [] } = {}, use) {
  const playwright = await import('playwright-core');
  const server = await startServer({ mounts: { '/minilm/': HERE, ...mounts } });
  try {
    const args = jsFlags.length ? [...LAUNCH_ARGS, `--js-flags=${jsFlags.join(' ')}`] : LAUNCH_ARGS;
    const browser = await playwright.chromium.launch({ executablePath: CHROMIUM, args });
    try {
      const page = await browser.newPage(viewport ? { viewport } : {});
      const errors = [];
      page.on('pageerror', (e) => errors.push(e.message));
      await page.goto(`${server.url}${path}`);
      const result = await use(page, server);
      if (errors.length) throw new Error(`the page failed: ${errors.join('; ')}`);
      return result;
    } finally {
      await browser.close();
    }
  } finally {
    await server.close();
  }
}

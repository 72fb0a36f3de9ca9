// A cross-origin isolated page of headless Chromium for the bench and the tuner (chromium_bench.mjs,
// chromium_time.mjs): runtime/serve.mjs on 127.0.0.1 serving `mounts`, the browser driven by
// playwright-core (this checkout's node_modules, or the current directory's: an installed wheel's
// copy of these files has none beside it), V8's optimizing tier from the first call as Node is run.

import { writeFile } from 'node:fs/promises';
import { createRequire } from 'node:module';
import { join } from 'node:path';
import { pathToFileURL } from 'node:url';

const LAUNCH_ARGS = ['--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking',
  '--disable-component-update', '--disable-sync', '--no-first-run', '--js-flags=--no-liftoff'];

async function playwrightCore() {
  try {
    return await import('playwright-core');
  } catch {  // (a CommonJS package: require gives its exports, where import() of its file would not)
    return createRequire(join(process.cwd(), 'package.json'))('playwright-core');
  }
}

/**
 * Serve `mounts` ({'/prefix/': dir}) with runtime/serve.mjs from `runtimeDir`, open a blank page
 * written into `pageDir` (mounted at `pagePrefix`) in `chromium` (its executable) and resolve to
 * what `use(page, url, version)` resolves to (`url`: the server's, `version`: "chromium <version>").
 * Rejects if the page threw; everything is closed afterwards.
 */
export async function withChromiumPage({ chromium, runtimeDir, mounts, pageDir, pagePrefix }, use) {
  await writeFile(join(pageDir, 'page.html'), '<!doctype html><meta charset="utf-8"><title>kernelgen</title>\n');
  const { startServer } = await import(pathToFileURL(join(runtimeDir, 'serve.mjs')).href);
  const playwright = await playwrightCore();
  const server = await startServer({ mounts: { ...mounts, [pagePrefix]: pageDir } });
  try {
    const browser = await playwright.chromium.launch({ executablePath: chromium, args: LAUNCH_ARGS });
    try {
      const page = await browser.newPage();
      const errors = [];
      page.on('pageerror', (e) => errors.push(e.message));
      await page.goto(`${server.url}${pagePrefix.slice(1)}page.html`);
      if (!await page.evaluate(() => globalThis.crossOriginIsolated)) throw new Error('the page is not cross-origin isolated');
      const result = await use(page, server.url, `chromium ${browser.version()}`);
      if (errors.length) throw new Error(`the page failed: ${errors.join('; ')}`);
      return result;
    } finally {
      await browser.close();
    }
  } finally {
    await server.close();
  }
}

// A cross-origin isolated page of headless Chromium for the bench and the tuner (chromium_bench.mjs,
// chromium_time.mjs): runtime/chromium.mjs's page, the browser driven by playwright-core (this
// checkout's node_modules, or the current directory's: an installed wheel's copy of these files has
// none beside it), V8's optimizing tier from the first call as Node is run.

import { writeFile } from 'node:fs/promises';
import { createRequire } from 'node:module';
import { join } from 'node:path';
import { pathToFileURL } from 'node:url';

async function playwrightCore() {
  try {
    return await import('playwright-core');
  } catch {  // (a CommonJS package: require gives its exports, where import() of its file would not)
    return createRequire(join(process.cwd(), 'package.json'))('playwright-core');
  }
}

/**
 * Serve `mounts` ({'/prefix/': dir}) with runtime/chromium.mjs from `runtimeDir`, open a blank page
 * written into `pageDir` (mounted at `pagePrefix`) in `chromium` (its executable) and resolve to
 * what `use(page, url, version)` resolves to (`url`: the server's, `version`: "chromium <version>").
 * Rejects if the page threw or is not cross-origin isolated; everything is closed afterwards.
 */
export async function withChromiumPage({ chromium, runtimeDir, mounts, pageDir, pagePrefix }, use) {
  await writeFile(join(pageDir, 'page.html'), '<!doctype html><meta charset="utf-8"><title>kernelgen</title>\n');
  const { withPage } = await import(pathToFileURL(join(runtimeDir, 'chromium.mjs')).href);
  const options = { playwright: await playwrightCore(), chromium, mounts: { ...mounts, [pagePrefix]: pageDir },
    path: `${pagePrefix.slice(1)}page.html`, jsFlags: ['--no-liftoff'] };
  return withPage(options, async (page, server, version) => {
    if (!await page.evaluate(() => globalThis.crossOriginIsolated)) throw new Error('the page is not cross-origin isolated');
    return use(page, server.url, version);
  });
}

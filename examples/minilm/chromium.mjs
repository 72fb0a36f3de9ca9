// The example's scripts that run the model in a browser (embed.mjs, bench.mjs, demo/drive.mjs) on
// runtime/chromium.mjs's page, with this directory served at /minilm/.

import { dirname } from 'node:path';
import { fileURLToPath } from 'node:url';

import { withPage as withRuntimePage } from '../../runtime/chromium.mjs';

const HERE = dirname(fileURLToPath(import.meta.url));

/**
 * Serve runtime/, out/, this directory at /minilm/ and `mounts` ({'/model/': dir}); open `path`
 * (default /minilm/) and run `use(page, server)`. `jsFlags`: V8 flags for the browser (the
 * benchmark passes Node's --no-liftoff). Resolves to what `use` resolves to; rejects if the page
 * threw an uncaught error. Everything is closed afterwards.
 */
export async function withPage({ mounts = {}, path = 'minilm/', viewport, jsFlags = [] } = {}, use) {
  const playwright = await import('playwright-core');
  return withRuntimePage({ playwright, mounts: { '/minilm/': HERE, ...mounts }, path, viewport, jsFlags }, use);
}

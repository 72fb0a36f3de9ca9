// A small static server for the demo and the browser test: the repository's runtime/ and out/
// on 127.0.0.1, with the two headers that make a page cross-origin isolated (and so give it
// SharedArrayBuffer and shared wasm memory: threads).
//
//   node runtime/serve.mjs [--port N] [--no-isolation] [--mount /vectors/=DIR]
//
// prints the demo's URL. startServer() does the same for tests.

import { createReadStream } from 'node:fs';
import { stat } from 'node:fs/promises';
import { createServer } from 'node:http';
import { extname, resolve, sep } from 'node:path';
import { fileURLToPath } from 'node:url';

const ROOT = fileURLToPath(new URL('..', import.meta.url));
const HOST = '127.0.0.1';
const TYPES = {
  '.html': 'text/html; charset=utf-8', '.mjs': 'text/javascript; charset=utf-8', '.js': 'text/javascript; charset=utf-8',
  '.css': 'text/css; charset=utf-8', '.json': 'application/json', '.wasm': 'application/wasm', '.wat': 'text/plain; charset=utf-8',
  '.bin': 'application/octet-stream', '.png': 'image/png', '.gguf': 'application/octet-stream',
};
const ISOLATION_HEADERS = {
  'Cross-Origin-Opener-Policy': 'same-origin',
  'Cross-Origin-Embedder-Policy': 'require-corp',
};

/**
 * Serve /runtime/ and /out/ of the repository, plus `mounts` ({'/vectors/': dir}), on a free port
 * of 127.0.0.1 (or `port`). `isolate: false` leaves the isolation headers out (to see the
 * one-thread fallback); `ranges: false` answers a range request with the whole file, as some
 * servers do (loadGguf reads a model by ranges). Resolves to {url, close()}.
 */
export async function startServer({ port = 0, isolate = true, mounts = {}, ranges = true } = {}) {
  const roots = { '/runtime/': resolve(ROOT, 'runtime'), '/out/': resolve(ROOT, 'out') };
  for (const [prefix, dir] of Object.entries(mounts)) roots[prefix] = resolve(dir);
  const server = createServer(async (req, res) => {
    const headers = { 'Cache-Control': 'no-store', ...(isolate ? ISOLATION_HEADERS : {}) };
    const path = decodeURIComponent(new URL(req.url, 'http://x').pathname);
    if (path === '/') {
      res.writeHead(302, { ...headers, Location: '/runtime/demo/' }).end();
      return;
    }
    const prefix = Object.keys(roots).find((p) => path.startsWith(p));
    let file = prefix && resolve(roots[prefix], `.${path.slice(prefix.length - 1)}`);
    if (file && path.endsWith('/')) file = resolve(file, 'index.html');
    // Nothing outside the served directories, whatever the path says.
    const inside = file && (file === roots[prefix] || file.startsWith(roots[prefix] + sep));
    const info = inside && (req.method === 'GET' || req.method === 'HEAD') && await stat(file).catch(() => null);
    if (!info?.isFile()) {
      res.writeHead(404, { ...headers, 'Content-Type': 'text/plain' }).end(`not found: ${path}\n`);
      return;
    }
    headers['Content-Type'] = TYPES[extname(file)] ?? 'application/octet-stream';
    if (ranges) headers['Accept-Ranges'] = 'bytes';
    // one range, bytes=a-b or bytes=a- (what loadGguf asks for); anything else gets the whole file
    const range = ranges && /^bytes=(\d+)-(\d*)$/.exec(req.headers.range ?? '');
    let [start, end] = [0, info.size - 1];
    if (range) {
      [start, end] = [Number(range[1]), range[2] === '' ? info.size - 1 : Math.min(Number(range[2]), info.size - 1)];
      if (start >= info.size || start > end) {
        res.writeHead(416, { ...headers, 'Content-Range': `bytes */${info.size}` }).end();
        return;
      }
      headers['Content-Range'] = `bytes ${start}-${end}/${info.size}`;
    }
    res.writeHead(range ? 206 : 200, { ...headers, 'Content-Length': end - start + 1 });
    if (req.method === 'HEAD' || info.size === 0) res.end();
    else createReadStream(file, { start, end }).pipe(res);
  });
  await new Promise((ok, fail) => server.once('error', fail).listen(port, HOST, ok));
  return {
    url: `http://${HOST}:${server.address().port}/`,
    close: () => new Promise((ok) => { server.closeAllConnections(); server.close(ok); }),
  };
}

function parseArgs(argv) {
  const opts = { mounts: {} };
  for (let i = 0; i < argv.length; i++) {
    if (argv[i] === '--port') opts.port = Number(argv[++i]);
    else if (argv[i] === '--no-isolation') opts.isolate = false;
    else if (argv[i] === '--mount') {
      const [prefix, dir] = argv[++i].split('=');
      opts.mounts[prefix.endsWith('/') ? prefix : `${prefix}/`] = dir;
    } else throw new Error(`unknown argument ${argv[i]}; use [--port N] [--no-isolation] [--mount /prefix/=DIR]`);
  }
  return opts;
}

if (process.argv[1] && resolve(process.argv[1]) === fileURLToPath(import.meta.url)) {
  const { url } = await startServer(parseArgs(process.argv.slice(2)));
  console.log(`serving runtime/ and out/ at ${url} (demo: ${url}runtime/demo/)`);
}

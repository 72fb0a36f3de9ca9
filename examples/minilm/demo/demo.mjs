// The MiniLM demo page: embed the corpus (sentences.txt) in batches with a progress bar, then answer
// typed queries with the top 5 sentences, their cosine scores and the milliseconds per query.
//
// Served by runtime/serve.mjs with this folder's parent at /minilm/ and export.py's model file and
// the model's tokenizer.json under /model/ (README: "A real model"); URL parameters: threads,
// limit (embed only the first N sentences), model and tokenizer (URLs). window.minilmDemo holds
// the state the browser test reads; <body data-state> is loading, ready, searching or failed.

import { loadKernels } from '/runtime/kernelgen.mjs';
import { MiniLM } from '../minilm.mjs';
import { WordPiece } from '../wordpiece.mjs';

const BATCH = 8;
const TOP = 5;
const params = new URLSearchParams(location.search);
const $ = (id) => document.getElementById(id);
const demo = { state: 'loading', error: null, info: null, sentences: 0, corpusMs: null, results: [] };
window.minilmDemo = demo;

function setState(state) {
  demo.state = state;
  document.body.dataset.state = state;
}

async function fetchOk(url) {
  const r = await fetch(url);
  if (!r.ok) throw new Error(`${url}: HTTP ${r.status}`);
  return r;
}

async function main() {
  setState('loading');
  const threads = params.has('threads') ? Number(params.get('threads')) : undefined;
  const [k, modelBytes, tokenizer, text] = await Promise.all([
    loadKernels({ threads }),
    fetchOk(params.get('model') ?? '/model/minilm-q8_0.safetensors').then((r) => r.arrayBuffer()),
    fetchOk(params.get('tokenizer') ?? '/model/tokenizer.json').then((r) => r.json()),
    fetchOk('../sentences.txt').then((r) => r.text()),
  ]);
  demo.info = k.info;
  const model = await MiniLM.load(k, new Uint8Array(modelBytes));
  const tok = WordPiece.fromJson(tokenizer);
  const opts = { threads: k.info.threads > 1 };
  const sentences = text.split('\n').filter((s) => s).slice(0, Number(params.get('limit') ?? Infinity));
  const n = model.hidden;
  const corpus = new Float32Array(sentences.length * n);
  $('progress').max = sentences.length;
  const start = performance.now();
  for (let i = 0; i < sentences.length; i += BATCH) {
    const batch = sentences.slice(i, i + BATCH);
    corpus.set(await model.embed(batch.map((s) => tok.encode(s)), opts), i * n);
    $('progress').value = i + batch.length;
    $('status').textContent = `embedding the corpus: ${i + batch.length} / ${sentences.length} sentences`;
  }
  demo.corpusMs = performance.now() - start;
  demo.sentences = sentences.length;
  $('status').textContent = `${sentences.length} sentences embedded in ${(demo.corpusMs / 1000).toFixed(1)} s `
    + `(${k.info.target}, ${k.info.threads} thread${k.info.threads > 1 ? 's' : ''})`;

  async function search(query) {
    setState('searching');
    const t0 = performance.now();
    const q = await model.embed([tok.encode(query)], opts);
    const scores = sentences.map((_, i) => {
      let s = 0;
      for (let c = 0; c < n; c++) s += q[c] * corpus[i * n + c];
      return s;
    });
    const top = scores.map((score, index) => ({ index, score })).sort((a, b) => b.score - a.score).slice(0, TOP);
    const ms = performance.now() - t0;
    demo.results.push({ query, ms, top });
    $('timing').textContent = `“${query}”: ${ms.toFixed(1)} ms (tokenize, embed, score ${sentences.length} sentences)`;
    $('results').tBodies[0].replaceChildren(...top.map(({ index, score }, rank) => {
      const tr = document.createElement('tr');
      for (const [v, cls] of [[rank + 1], [sentences[index]], [score.toFixed(4), 'score']]) {
        const td = document.createElement('td');
        td.textContent = v;
        if (cls) td.className = cls;
        tr.append(td);
      }
      return tr;
    }));
    setState('ready');
  }

  $('search').addEventListener('submit', (e) => {
    e.preventDefault();
    const query = $('query').value.trim();
    if (query) search(query).catch(fail);
  });
  $('query').disabled = false;
  $('go').disabled = false;
  setState('ready');
}

function fail(e) {
  demo.error = String(e?.stack ?? e);
  $('status').textContent = `failed: ${e?.message ?? e}`;
  $('status').className = 'bad';
  setState('failed');
}

main().catch(fail);

// BERT's uncased WordPiece tokenizer in JS, read from the model's tokenizer.json: the ids the
// `tokenizers` package gives for all-MiniLM-L6-v2 (tests/test_minilm.py checks the whole corpus and
// adversarial text), so a page can tokenize what it embeds.
//
//   const tok = WordPiece.fromJson(JSON.parse(text));   // tokenizer.json
//   tok.encode('Why is the sky blue?')                 // [101, 2339, 2003, 1996, 3712, 2630, 1029, 102]
//
//   node examples/minilm/wordpiece.mjs tokenizer.json TEXTS.json   # prints [[ids...], ...]
//
// The steps are the file's: BertNormalizer (drop NUL, U+FFFD and control characters, whitespace
// to ' ', spaces around CJK ideographs, NFD without non-spacing marks, lower case), BertPreTokenizer
// (split at whitespace, each punctuation character a word), WordPiece (greedy longest match, '##'
// continuations, [UNK] for a word that does not split or is over max_input_chars_per_word), then
// [CLS] ... [SEP] truncated to the file's max_length.

const CONTROL = /[\p{Cc}\p{Cf}\p{Co}\p{Cn}]/u;
const WHITESPACE = /\p{White_Space}/u;
const PUNCTUATION = /[!-/:-@[-`{-~\p{P}]/u;
const NONSPACING_MARK = /\p{Mn}/gu;
// CJK ideograph blocks, surrounded by spaces (BERT's _is_chinese_char).
const CJK = [[0x4e00, 0x9fff], [0x3400, 0x4dbf], [0x20000, 0x2a6df], [0x2a700, 0x2b73f], [0x2b740, 0x2b81f],
  [0x2b820, 0x2ceaf], [0xf900, 0xfaff], [0x2f800, 0x2fa1f]];
const isCjk = (cp) => CJK.some(([lo, hi]) => cp >= lo && cp <= hi);

export class WordPiece {
  /** From a parsed tokenizer.json; refuses one that is not a BERT WordPiece of this shape. */
  static fromJson(json) {
    const { model, normalizer, pre_tokenizer: pre, truncation } = json ?? {};
    if (model?.type !== 'WordPiece' || normalizer?.type !== 'BertNormalizer' || pre?.type !== 'BertPreTokenizer'
        || normalizer.lowercase !== true || normalizer.strip_accents === false || !normalizer.clean_text || !normalizer.handle_chinese_chars) {
      throw new TypeError('WordPiece.fromJson: expected an uncased BERT WordPiece tokenizer.json (BertNormalizer with '
        + 'lowercase, clean_text and handle_chinese_chars, BertPreTokenizer)');
    }
    return new WordPiece(new Map(Object.entries(model.vocab)), model.unk_token, model.continuing_subword_prefix,
      model.max_input_chars_per_word, truncation?.max_length ?? Infinity);
  }

  constructor(vocab, unk, prefix, maxWordChars, maxLength) {
    this.vocab = vocab;
    this.prefix = prefix;
    this.maxWordChars = maxWordChars;
    this.maxLength = maxLength;
    this.ids = Object.fromEntries(['[CLS]', '[SEP]', unk].map((t) => {
      if (!vocab.has(t)) throw new TypeError(`WordPiece: the vocabulary has no ${t}`);
      return [t, vocab.get(t)];
    }));
    this.unkId = vocab.get(unk);
  }

  /** BertNormalizer, then BertPreTokenizer: the words. */
  words(text) {
    let clean = '';
    for (const ch of text) {
      const cp = ch.codePointAt(0);
      if (cp === 0 || cp === 0xfffd) continue;
      if (ch === '\t' || ch === '\n' || ch === '\r' || WHITESPACE.test(ch)) clean += ' ';
      else if (CONTROL.test(ch)) continue;
      else if (isCjk(cp)) clean += ` ${ch} `;
      else clean += ch;
    }
    const normalized = clean.normalize('NFD').replace(NONSPACING_MARK, '').toLowerCase();
    const words = [];
    let word = '';
    for (const ch of normalized) {
      if (ch === ' ' || WHITESPACE.test(ch) || PUNCTUATION.test(ch)) {
        if (word) words.push(word);
        word = '';
        if (PUNCTUATION.test(ch)) words.push(ch);
      } else word += ch;
    }
    if (word) words.push(word);
    return words;
  }

  /** One word's pieces' ids: greedy longest match, [UNK] alone if the word does not split. */
  pieces(word) {
    const chars = Array.from(word);
    if (chars.length > this.maxWordChars) return [this.unkId];
    const ids = [];
    for (let start = 0; start < chars.length;) {
      let end = chars.length;
      let id;
      for (; end > start; end--) {
        id = this.vocab.get((start > 0 ? this.prefix : '') + chars.slice(start, end).join(''));
        if (id !== undefined) break;
      }
      if (end === start) return [this.unkId];
      ids.push(id);
      start = end;
    }
    return ids;
  }

  /** [CLS] pieces [SEP], at most maxLength ids. */
  encode(text) {
    if (typeof text !== 'string') throw new TypeError(`WordPiece.encode: expected a string, got ${typeof text}`);
    const ids = this.words(text).flatMap((w) => this.pieces(w)).slice(0, this.maxLength - 2);
    return [this.ids['[CLS]'], ...ids, this.ids['[SEP]']];
  }
}

// The command line (Node only: a page imports this module for the class).
const argv = globalThis.process?.argv;
if (argv?.[1] && argv[1].endsWith('wordpiece.mjs')) {
  const [{ readFileSync }, { resolve }, { fileURLToPath }] = await Promise.all([import('node:fs'), import('node:path'), import('node:url')]);
  if (resolve(argv[1]) === fileURLToPath(import.meta.url)) {
    if (argv.length !== 4) {
      console.error('usage: wordpiece.mjs tokenizer.json TEXTS.json');
      process.exit(2);
    }
    const tok = WordPiece.fromJson(JSON.parse(readFileSync(argv[2], 'utf8')));
    console.log(JSON.stringify(JSON.parse(readFileSync(argv[3], 'utf8')).map((t) => tok.encode(t))));
  }
}

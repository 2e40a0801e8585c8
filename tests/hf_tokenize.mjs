// hf_tokenize.mjs DIR: Hugging Face's tokenizers.js (npm @huggingface/tokenizers, installed by
// `npm ci --prefix tests/clients`) on DIR/tokenizer.json + tokenizer_config.json: for every
// string of DIR/texts.json, its ids (no special tokens added) and the text they decode to
// (special tokens kept), as one JSON array [{ids, text}] on stdout.
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { join } from "node:path";

const dir = process.argv[2];
const require = createRequire(new URL("./clients/package.json", import.meta.url));
const { Tokenizer } = require("@huggingface/tokenizers");
const read = (name) => JSON.parse(readFileSync(join(dir, name), "utf8"));
const tokenizer = new Tokenizer(read("tokenizer.json"), read("tokenizer_config.json"));
const out = read("texts.json").map((text) => {
  const { ids } = tokenizer.encode(text, { add_special_tokens: false });
  return { ids, text: ids.length ? tokenizer.decode(ids, { skip_special_tokens: false }) : "" };
});
process.stdout.write(JSON.stringify(out));

// tests/gguf_read.mjs: read a GGUF file with Hugging Face's independent parser (@huggingface/gguf,
// npm) and print what it sees as JSON: the metadata (numbers and strings; arrays by length), the
// tensor directory (name, ggml type id, shape, offset) and where the data section starts.
// Used by the quantize suite to check that a file `moe quantize` writes reads as GGUF by code
// moe did not write. usage: node tests/gguf_read.mjs FILE.gguf
import { gguf } from "@huggingface/gguf";

const path = process.argv[2];
const { metadata, tensorInfos, tensorDataOffset } = await gguf(path, { allowLocalFile: true });
const meta = {};
for (const [k, v] of Object.entries(metadata)) {
  if (Array.isArray(v)) meta[k] = { array: v.length };
  else if (typeof v === "bigint") meta[k] = Number(v);
  else meta[k] = v;
}
const tensors = tensorInfos.map((t) => ({
  name: t.name,
  type: Number(t.dtype),
  shape: t.shape.map(Number),
  offset: Number(t.offset),
}));
console.log(JSON.stringify({ metadata: meta, tensors, data_offset: Number(tensorDataOffset) }));

#!/usr/bin/python3
"""A small Gemma-4-style tokenizer for the tokenizer suite, written from the formats'
descriptions (no tokenizer library): the same vocabulary and merges twice.

  gemma4_tokenizer.py DIR [STRINGS.inp]

DIR/tokenizer.json   Hugging Face's form of a Gemma tokenizer: normalizer Replace " " -> U+2581,
                     pre_tokenizer Split on "\\n+" (Isolated), model BPE with byte_fallback and
                     merges as [a, b] pairs, decoder Replace U+2581 -> " " / ByteFallback / Fuse,
                     the control tokens as special added tokens.
DIR/tokenizer_config.json
DIR/vocab.gguf       a vocab-only GGUF with the keys llama.cpp's converter writes for a Gemma 4
                     vocabulary: tokenizer.ggml.model = "gemma4" (and no pre), tokens, scores,
                     token_type (control 3, unknown 2, byte 6, normal 1), merges "a b", the
                     special ids, add_bos_token.
DIR/texts.json       the strings to tokenize: a few of our own (spaces, newline runs, special
                     token text, characters with no token) and, when given, every string of a
                     llama.cpp vocabulary test file (separated by "\\n__ggml_vocab_test__\\n").

The vocabulary: <pad> <eos> <bos> <unk> <start_of_turn> <end_of_turn>, the 256 <0xNN> byte
tokens, every character of TEXT (spaces as U+2581), then merges learned from TEXT by counting
pairs (most frequent first, the smallest pair on ties) inside words as SentencePiece trains:
a word starts at each U+2581, and a run of newlines is a word of its own.
"""
import json
import os
import re
import struct
import sys

from qat_checkpoint import learn_merges

SPACE = "\u2581"
CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
N_MERGES = 300
TEXT = ("Once upon a time there was a little model that ran on a small computer.\n\n"
        "It read the weights of the other models, and it was happy when the numbers were the "
        "same.  The end of the story is that every token came back again.\n"
        "def main():\n    return 1234 + 5678\n\n"
        "Tabs\tand  double  spaces, commas, dots... and (brackets) [too]!\n\n"
        "The quick brown fox jumps over the lazy dog; the dog sleeps.\n")
OURS = ["Hello world", "  two  spaces  ", "line one\nline two\n\n\nthree\n\n", "\n", "\n\n\n\n",
        "<start_of_turn>user\nOnce upon a time<end_of_turn>\n", "\u041f\u0440\u0438\u0432\u0435\u0442 "
        "\u043c\u0438\u0440", "emoji \U0001F642 ok", "numbers 0123456789", "a", " ",
        "tabs\tand\ttabs", "end with space "]


def words(text):
    escaped = text.replace(" ", SPACE)
    out = []
    for run in re.findall(r"\n+|[^\n]+", escaped):
        out += [run] if run[0] == "\n" else [w for w in re.split("(?=" + SPACE + ")", run) if w]
    return out


def train():
    vocab = {t: i for i, t in enumerate(CONTROL)}
    for b in range(256):
        vocab["<0x%02X>" % b] = len(vocab)
    for ch in sorted(set(TEXT.replace(" ", SPACE))):
        vocab.setdefault(ch, len(vocab))
    counts = {}
    for w in words(TEXT):
        counts[tuple(w)] = counts.get(tuple(w), 0) + 1
    return vocab, learn_merges(counts, vocab, len(vocab) + N_MERGES)


def write_json(d, vocab, merges):
    added = [{"id": vocab[t], "content": t, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True} for t in CONTROL]
    t = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
         "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": SPACE},
         "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "\\n+"},
                           "behavior": "Isolated", "invert": False},
         "post_processor": None,
         "decoder": {"type": "Sequence", "decoders": [
             {"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
             {"type": "ByteFallback"}, {"type": "Fuse"}]},
         "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>",
                   "continuing_subword_prefix": None, "end_of_word_suffix": None,
                   "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                   "vocab": vocab, "merges": [list(m) for m in merges]}}
    json.dump(t, open(os.path.join(d, "tokenizer.json"), "w"), ensure_ascii=False)
    cfg = {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>",
           "add_bos_token": True, "add_eos_token": False,
           "clean_up_tokenization_spaces": False}  # as Gemma's; moe never cleans spaces
    json.dump(cfg, open(os.path.join(d, "tokenizer_config.json"), "w"))


def gguf_string(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def write_gguf(path, vocab, merges):
    """GGUF v3 from its description: header, key/values, no tensors"""
    tokens = sorted(vocab, key=vocab.get)
    types = [3 if t in CONTROL else 6 if re.fullmatch(r"<0x[0-9A-F]{2}>", t) else 1
             for t in tokens]
    types[vocab["<unk>"]] = 2
    kv = [("general.architecture", 8, "gemma4"), ("tokenizer.ggml.model", 8, "gemma4"),
          ("tokenizer.ggml.tokens", (9, 8), tokens),
          ("tokenizer.ggml.scores", (9, 6), [-1000.0 if t == 3 else 0.0 for t in types]),
          ("tokenizer.ggml.token_type", (9, 5), types),
          ("tokenizer.ggml.merges", (9, 8), [a + " " + b for a, b in merges]),
          ("tokenizer.ggml.bos_token_id", 4, vocab["<bos>"]),
          ("tokenizer.ggml.eos_token_id", 4, vocab["<eos>"]),
          ("tokenizer.ggml.unknown_token_id", 4, vocab["<unk>"]),
          ("tokenizer.ggml.padding_token_id", 4, vocab["<pad>"]),
          ("tokenizer.ggml.add_bos_token", 7, True), ("tokenizer.ggml.add_eos_token", 7, False)]
    scalar = {4: "<I", 5: "<i", 6: "<f", 7: "<?"}
    out = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv))
    for key, t, v in kv:
        out += gguf_string(key)
        if isinstance(t, tuple):
            out += struct.pack("<IIQ", 9, t[1], len(v))
            for x in v:
                out += gguf_string(x) if t[1] == 8 else struct.pack(scalar[t[1]], x)
        else:
            out += struct.pack("<I", t)
            out += gguf_string(v) if t == 8 else struct.pack(scalar[t], v)
    out += b"\0" * (-len(out) % 32)
    open(path, "wb").write(out)


def main():
    d = sys.argv[1]
    os.makedirs(d, exist_ok=True)
    vocab, merges = train()
    write_json(d, vocab, merges)
    write_gguf(os.path.join(d, "vocab.gguf"), vocab, merges)
    texts = list(OURS)
    if len(sys.argv) > 2:
        texts += open(sys.argv[2], encoding="utf-8").read().split("\n__ggml_vocab_test__\n")
    json.dump(texts, open(os.path.join(d, "texts.json"), "w"), ensure_ascii=False)
    print(len(vocab), "tokens,", len(merges), "merges,", len(texts), "texts")


if __name__ == "__main__":
    main()

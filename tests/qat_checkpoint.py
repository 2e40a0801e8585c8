#!/usr/bin/python3
"""Synthetic checkpoints for the safetensors and repack suites, and independent checks of what
moe writes. numpy only (no torch, no safetensors package): the safetensors and GGUF readers
below are written from the formats' specifications, not from moe's code.

  qat_checkpoint.py qat DIR [--seed S] [--offgrid] [--tokenizer N]
      A gemma4-shaped QAT checkpoint (the dimensions of ../shared/parity/gemma4-moe-q4_0, HF
      names, config.json, two shards + model.safetensors.index.json). Every group of 32 along
      the input dimension is bf16(step x level), step an 8-bit number that bf16 and f16 hold
      exactly, level in -8..7, the group's peak at level +-m for m cycling 0 (an all-zero
      group), 1..8; the levels of a group share no common factor. With --offgrid two tensors
      get groups with one value moved off the grid. Writes DIR/expected.json (group counts per
      m, off-grid tensors and groups) and DIR/levels/<tensor>.i8 (every generated level).
      --tokenizer N adds a tokenizer.json of N tokens + 4 added ones (its size is all that
      matters: the converter keeps that many rows of embed_tokens). --bpe-tokenizer N instead
      adds a working byte-level BPE tokenizer.json (256 bytes + merges learned from a fixed
      text up to N tokens, then <bos> <eos> <start_of_turn> <end_of_turn>) and a
      tokenizer_config.json with BOS and a chat template: a complete small gemma4 model.
      --embed-std S draws embed_tokens with standard deviation S (0.05 as every copied tensor
      by default).
  qat_checkpoint.py check-view SRC OUT VIEW.gguf
      VIEW.gguf is the W4A16 checkpoint OUT as the engine reads it (moe_hf_open), written at
      F32 by `moe quantize OUT VIEW.gguf --rule .=F32`: llama.cpp's names and shapes, every
      quantized tensor equal to the decompressed modules (experts stacked back), the rest to
      the source, bit for bit.
  qat_checkpoint.py hf-from-gguf MODEL.gguf DIR
      A Hugging Face checkpoint (F32, config.json) of a llama or qwen3moe GGUF's weights (F32 or
      Q8_0) dequantized: HF's names, one tensor per expert, llama's q / k rows in HF's order
      (the inverse of the converter's permute).
  qat_checkpoint.py qwen35-from-gguf MODEL.gguf DIR [--keep-norm] [--keep-a-log] [--keep-v-heads]
      A Qwen3.5 Hugging Face checkpoint (F32, HF's names and layout, its MTP block, config.json)
      of a qwen35 GGUF's weights: every edit llama.cpp's converter makes undone (norms as w - 1,
      A_log = log(-A), conv1d [channels][1][kernel], the value heads in HF's grouped order);
      --keep-X leaves that one out, writing a checkpoint the converter would misread.
  qat_checkpoint.py w4a16-twins SRC W4A16_DIR F32_DIR
      SRC (an F32 checkpoint) with its 2-D weights as compressed-tensors W4A16 modules (levels
      round(w / scale), bf16 scale max|w| / 7), and the same values scale x level at F32.
  qat_checkpoint.py same-gguf A.gguf B.gguf
      The two files hold the same tensors (names, shapes) with the same values (F32, Q4_0).
  qat_checkpoint.py set-scale OUT MODULE VALUE
      Overwrites the first scale of a W4A16 module with bf16(VALUE) (an error test's input).
  qat_checkpoint.py check-w4a16 SRC OUT
      Reads OUT (compressed-tensors pack-quantized) and checks every module's levels against
      the generated ones, scale x level against the source values, copied tensors byte for
      byte, weight_shape and quantization_config.
  qat_checkpoint.py check-gguf SRC OUT.gguf FIXTURE.json [--vocab]
      Reads the GGUF and checks Q4_0 levels against the generated ones, d x level against the
      source, F32 / BF16 copies, and the tensor names, shapes, types and metadata against the
      llama.cpp-made fixture's (FIXTURE.json); --vocab: its tokenizer.* keys too.
  qat_checkpoint.py dequant-w4a16 OUT MODULE FILE.f32
      One module of a W4A16 checkpoint dequantized as compressed-tensors does (float32).
  qat_checkpoint.py dtypes FILE.safetensors FILE.f32
      One tensor of every dtype moe reads, and their values as float32 (numpy's conversion;
      bf16 and F8_E4M3 decoded here from their bit layouts), for the reader test.
  qat_checkpoint.py read FILE.safetensors
      Prints name dtype shape and the float64 sum of every tensor (checks moe's writer).
Exit status 0 when every check passes; otherwise the first failure is printed.
"""
import json
import os
import struct
import sys

import numpy as np

GROUP = 32


# ==== safetensors, from the format description ====

def st_write(path, tensors, metadata=None):
    """tensors: list of (name, dtype string, shape, raw bytes)."""
    header = {}
    if metadata:
        header["__metadata__"] = metadata
    off = 0
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(raw)]}
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for _, _, _, raw in tensors:
            f.write(raw)


def st_read(path):
    """{name: (dtype, shape, raw bytes)}, metadata"""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__", None)
    out = {}
    for name, e in header.items():
        b, en = e["data_offsets"]
        out[name] = (e["dtype"], tuple(e["shape"]), data[8 + n + b:8 + n + en])
    return out, meta


def st_read_dir(d):
    idx = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(idx):
        files = sorted(set(json.load(open(idx))["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for f in files:
        out.update(st_read(os.path.join(d, f))[0])
    return out


def bf16_to_f32(raw):
    u = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
    return u.view(np.float32)


def f32_to_bf16_bits(x):
    """round to nearest even, as torch does"""
    u = np.atleast_1d(np.asarray(x, dtype=np.float32)).view(np.uint32).astype(np.uint64)
    sh, one = np.uint64(16), np.uint64(1)
    r = (u + np.uint64(0x7FFF) + ((u >> sh) & one)) >> sh
    return r.astype(np.uint16)


def f8_e4m3_to_f32(raw):
    out = []
    for b in raw:
        s, e, m = b >> 7, (b >> 3) & 15, b & 7
        if e == 15 and m == 7:
            v = float("nan")
        elif e == 0:
            v = m * 2.0 ** -9
        else:
            v = (1 + m / 8) * 2.0 ** (e - 7)
        out.append(-v if s else v)
    return np.array(out, dtype=np.float32)


# ==== the gemma4-shaped QAT checkpoint ====

D, LAYERS, HEADS, HD_SWA, HD_FULL, FF, E, TOPK, EFF, VOCAB = 64, 6, 4, 32, 64, 64, 8, 2, 32, 512
SWA = [True] * 5 + [False]
KV = [2] * 5 + [1]
NAME = "synth-shared-gemma4-moe-f32"  # the fixture's general.name: the converter takes the dir name
# (tensor, group) pairs moved off the grid with --offgrid
OFFGRID = {"model.language_model.layers.1.mlp.up_proj.weight": [0, 5, 17],
           "model.language_model.layers.2.experts.down_proj": [100]}


def config():
    t = {
        "model_type": "gemma4_text", "hidden_size": D, "intermediate_size": FF,
        "moe_intermediate_size": EFF, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV[0], "num_global_key_value_heads": KV[-1], "head_dim": HD_SWA,
        "global_head_dim": HD_FULL,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in SWA],
        "sliding_window": 8, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
        "num_experts": E, "top_k_experts": TOPK, "enable_moe_block": True,
        "final_logit_softcapping": 30.0, "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 0, "vocab_size": VOCAB, "attention_k_eq_v": True,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "full_attention": {"rope_type": "proportional", "rope_theta": 1000000.0,
                               "partial_rotary_factor": 0.25},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
    }
    return {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
            "text_config": t, "torch_dtype": "bfloat16"}


def tensor_list():
    """(name, shape, quantized) in HF layout"""
    p = "model.language_model."
    out = [(p + "embed_tokens.weight", (VOCAB, D), False)]
    for l in range(LAYERS):
        b = f"{p}layers.{l}."
        hd = HD_SWA if SWA[l] else HD_FULL
        out += [(b + "self_attn.q_proj.weight", (HEADS * hd, D), True),
                (b + "self_attn.k_proj.weight", (KV[l] * hd, D), True)]
        if SWA[l]:
            out.append((b + "self_attn.v_proj.weight", (KV[l] * hd, D), True))
        out += [(b + "self_attn.o_proj.weight", (D, HEADS * hd), True),
                (b + "self_attn.q_norm.weight", (hd,), False),
                (b + "self_attn.k_norm.weight", (hd,), False)]
        for n in ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm", "post_feedforward_layernorm_1",
                  "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2"]:
            out.append((b + n + ".weight", (D,), False))
        out += [(b + "mlp.gate_proj.weight", (FF, D), True),
                (b + "mlp.up_proj.weight", (FF, D), True),
                (b + "mlp.down_proj.weight", (D, FF), True),
                (b + "router.proj.weight", (E, D), False),
                (b + "router.scale", (D,), False),
                (b + "router.per_expert_scale", (E,), False),
                (b + "experts.gate_up_proj", (E, 2 * EFF, D), True),
                (b + "experts.down_proj", (E, D, EFF), True),
                (b + "layer_scalar", (1,), False)]
    out.append((p + "norm.weight", (D,), False))
    out.append(("model.vision_tower.encoder.layers.0.mlp.fc1.weight", (64, 32), False))
    return out


def qat_group(rng, m):
    """levels (int8[32]) with peak |level| m (m == 0: all zero) and no common factor"""
    if m == 0:
        return np.zeros(GROUP, dtype=np.int8)
    while True:
        lo, hi = -m, min(m, 7)
        lv = rng.integers(lo, hi + 1, size=GROUP)
        peak = -m if m == 8 or rng.integers(0, 2) else m
        lv[rng.integers(0, GROUP)] = peak
        if np.gcd.reduce(np.abs(lv)) == 1:
            return lv.astype(np.int8)


def add_tokenizer(d, n_vocab, n_added):
    """a tokenizer.json with n_vocab BPE entries and n_added added tokens (only counted)"""
    t = {"model": {"type": "BPE", "vocab": {f"t{i}": i for i in range(n_vocab)}, "merges": []},
         "added_tokens": [{"id": n_vocab + i, "content": f"<a{i}>"} for i in range(n_added)]}
    json.dump(t, open(os.path.join(d, "tokenizer.json"), "w"))


def byte_to_unicode():
    """GPT-2's printable stand-ins for the 256 bytes (the byte-level BPE alphabet)"""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


BPE_TEXT = ("Once upon a time there was a little model that ran on a small computer. "
            "It read the weights of the other models, and it was happy when the numbers "
            "were the same. The end of the story is that every token came back again. ")


def learn_merges(words, vocab, n_tokens):
    """BPE training: merge the most frequent adjacent pair of words ({tuple of symbols: count};
    the smallest pair on ties) until vocab holds n_tokens entries or no pair is left. New
    tokens are appended to vocab; returns the merges as (left, right) pairs."""
    merges = []
    while len(vocab) < n_tokens:
        pairs = {}
        for w, c in words.items():
            for p in zip(w, w[1:]):
                pairs[p] = pairs.get(p, 0) + c
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        vocab.setdefault(best[0] + best[1], len(vocab))
        new = {}
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new[tuple(out)] = new.get(tuple(out), 0) + c
        words = new
    return merges


def add_bpe_tokenizer(d, n_tokens):
    """a real byte-level BPE tokenizer.json: the 256 bytes, merges learned from BPE_TEXT until
    n_tokens, four added control tokens, GPT-2's pre-tokenizer; a tokenizer_config.json with
    BOS and a chat template"""
    b2u = byte_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    words = {}
    for w in BPE_TEXT.replace(" ", " \0").split("\0"):
        w = ("Ġ" if w.startswith(" ") else "") + w.strip()
        if w:
            words[tuple(w)] = words.get(tuple(w), 0) + 1
    merges = [a + " " + b for a, b in learn_merges(words, vocab, n_tokens)]
    added = ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]
    t = {"version": "1.0", "added_tokens": [
            {"id": len(vocab) + i, "content": a, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True} for i, a in enumerate(added)],
         "normalizer": None,
         "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                           "use_regex": True},
         "post_processor": None, "decoder": {"type": "ByteLevel"},
         "model": {"type": "BPE", "dropout": None, "unk_token": None, "fuse_unk": False,
                   "byte_fallback": False, "vocab": vocab, "merges": merges}}
    json.dump(t, open(os.path.join(d, "tokenizer.json"), "w"), ensure_ascii=False)
    cfg = {"bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": True,
           "add_eos_token": False,
           "chat_template": "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
                            "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
                            "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"}
    json.dump(cfg, open(os.path.join(d, "tokenizer_config.json"), "w"))


EMBED_STD = [0.05]  # --embed-std: larger embeddings give logits well above the rounding noise


def make_qat(d, seed, offgrid):
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(d, "levels"), exist_ok=True)
    json.dump(config(), open(os.path.join(d, "config.json"), "w"), indent=2)
    json.dump({"note": "not a real tokenizer"}, open(os.path.join(d, "tokenizer_config.json"), "w"))
    by_m = [0] * 9
    exp = {"groups": 0, "offgrid_groups": 0, "offgrid_tensors": {}, "quantized": [],
           "copied": []}
    shards = [[], []]
    g_all = 0
    for i, (name, shape, quant) in enumerate(tensor_list()):
        n = int(np.prod(shape))
        if quant:
            ng = n // GROUP
            levels = np.zeros((ng, GROUP), dtype=np.int8)
            steps = np.zeros(ng, dtype=np.float32)
            for g in range(ng):
                m = g_all % 9
                g_all += 1
                levels[g] = qat_group(rng, m)
                steps[g] = np.float32((128 + rng.integers(0, 128)) / 128 * 2.0 ** rng.integers(-12, -4))
            vals = (steps[:, None] * levels.astype(np.float32)).astype(np.float32)
            bits = f32_to_bf16_bits(vals)
            off = OFFGRID.get(name, []) if offgrid else []
            for g in off:  # one value a third of a step off its level
                v = np.float32(steps[g] * (float(levels[g, 7]) + 0.37))
                bits[g, 7] = f32_to_bf16_bits(v)[0]
            for g in range(ng):
                if g not in off:
                    by_m[int(np.abs(levels[g].astype(int)).max())] += 1
            exp["groups"] += ng
            exp["offgrid_groups"] += len(off)
            if off:
                exp["offgrid_tensors"][name] = off
            levels.tofile(os.path.join(d, "levels", name + ".i8"))
            exp["quantized"].append(name)
            raw = bits.astype("<u2").tobytes()
        else:
            if name.endswith("norm.weight") or name.endswith("scale") or name.endswith("scalar"):
                v = 1 + 0.05 * rng.standard_normal(n)
            else:
                v = (EMBED_STD[0] if "embed_tokens" in name else 0.05) * rng.standard_normal(n)
            raw = f32_to_bf16_bits(v.astype(np.float32)).astype("<u2").tobytes()
            exp["copied"].append(name)
        shards[0 if ".layers." not in name or ".layers.0." in name or ".layers.1." in name else 1].append(
            (name, "BF16", shape, raw))
    exp["groups_by_m"] = by_m
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    wm = {}
    for f, ts in zip(files, shards):
        st_write(os.path.join(d, f), ts, {"format": "pt"})
        for t in ts:
            wm[t[0]] = f
    json.dump({"metadata": {}, "weight_map": wm},
              open(os.path.join(d, "model.safetensors.index.json"), "w"), indent=1)
    json.dump(exp, open(os.path.join(d, "expected.json"), "w"), indent=1)


# ==== checks ====

class Fail(Exception):
    pass


def need(cond, msg):
    if not cond:
        raise Fail(msg)


def levels_of(src_dir, name, shape):
    return np.fromfile(os.path.join(src_dir, "levels", name + ".i8"), dtype=np.int8).reshape(
        int(np.prod(shape)) // GROUP, GROUP)


def check_group_values(src_vals, lv, scale, what):
    """scale x level rounded to bf16 is the source value, for every group"""
    back = bf16_to_f32(f32_to_bf16_bits(scale[:, None] * lv.astype(np.float32)).tobytes())
    bad = np.nonzero(back.reshape(-1) != src_vals.reshape(-1))[0]
    need(len(bad) == 0, f"{what}: value {bad[:1]} is not scale x level")


def unpack_int4(raw, rows, cols):
    """compressed-tensors unpack_from_int32 (num_bits 4, packed_dim 1)"""
    w = np.frombuffer(raw, dtype="<i4").reshape(rows, cols // 8).view(np.uint32)
    out = np.zeros((rows, cols), dtype=np.int16)
    for i in range(8):
        out[:, i::8] = (w >> (4 * i)) & 15
    return (out - 8).astype(np.int8)


def modules_of(name, shape):
    """the W4A16 modules (name, first row, rows) a quantized tensor is written as, in row order:
    one per 2-D weight, gate then up (or down) per expert of a fused 3-D one"""
    if len(shape) == 2:
        return [(name[:-len(".weight")], 0, shape[0])]
    stem = name[:name.rindex(".") + 1]
    rows = shape[1]
    mods = []
    for e in range(shape[0]):
        if name.endswith("gate_up_proj"):
            mods += [(f"{stem}{e}.gate_proj", e * rows, rows // 2),
                     (f"{stem}{e}.up_proj", e * rows + rows // 2, rows // 2)]
        else:
            mods.append((f"{stem}{e}.down_proj", e * rows, rows))
    return mods


def check_view(src, out, view):
    """VIEW.gguf: the W4A16 checkpoint OUT as moe serves it, converted to F32 by moe quantize.
    Every tensor under llama.cpp's name, every quantized one equal to compressed-tensors'
    decompression (scale x level, the modules stacked back into the fused experts) bit for bit,
    the others to the source's values"""
    exp = json.load(open(os.path.join(src, "expected.json")))
    o = st_read_dir(out)
    _, tensors = gguf_read(view)
    used = 0
    for name, shape, quant in tensor_list():
        g = hf_to_gguf(name)
        if g is None:
            continue
        need(g in tensors, f"{name}: no tensor {g}")
        t, ne, raw = tensors[g]
        need(t == 0, f"{g}: type {t}, not F32")
        got = np.frombuffer(raw, "<f4")
        if quant and name not in exp["offgrid_tensors"]:
            cols = shape[-1]
            parts = []
            for mod, _, nr in modules_of(name, shape):
                lv = unpack_int4(o[mod + ".weight_packed"][2], nr, cols).reshape(-1, GROUP)
                scale = bf16_to_f32(o[mod + ".weight_scale"][2])
                parts.append((lv.astype(np.float32) * scale[:, None]).reshape(-1))
            want = np.concatenate(parts)
        else:
            want = bf16_to_f32(o[name][2])[:got.size]  # token_embd: the tokenizer's rows
        need(got.size == want.size, f"{g}: {got.size} values, {want.size} expected")
        bad = np.nonzero(got != want)[0]
        need(len(bad) == 0, f"{g}: value {bad[:1]} is {got[bad[:1]]}, expected {want[bad[:1]]}")
        need(list(ne) == list(reversed(shape))[:len(ne)] or g == "token_embd.weight",
             f"{g}: ne {ne} for shape {shape}")
        used += 1
    need(used + 1 == len(tensors), f"{len(tensors)} tensors, {used} + rope_freqs accounted for")


def set_scale(d, module, value):
    """overwrite the first weight_scale of a W4A16 module in place with bf16(value)"""
    name = module + ".weight_scale"
    for f in sorted(os.listdir(d)):
        if not f.endswith(".safetensors"):
            continue
        path = os.path.join(d, f)
        with open(path, "r+b") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
            if name in header:
                need(header[name]["dtype"] == "BF16", f"{name}: not BF16")
                fh.seek(8 + n + header[name]["data_offsets"][0])
                fh.write(struct.pack("<H", int(f32_to_bf16_bits(np.array([value], np.float32))[0])))
                return
    raise Fail(f"no tensor {name} in {d}")


def q8_0_to_f32(raw):
    """ggml's Q8_0: blocks of an f16 scale and 32 int8, value = scale x q"""
    b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 34)
    d = b[:, :2].copy().view("<f2").astype(np.float32)
    return (d * b[:, 2:].copy().view(np.int8).astype(np.float32)).reshape(-1)


def hf_from_gguf(gguf, d):
    """a Hugging Face checkpoint (F32 safetensors, config.json) holding a llama or qwen3moe GGUF's
    weights (F32 or Q8_0, dequantized): HF names, experts one tensor each, and llama's q / k rows
    put back in HF's rotate-half order (the converter's permute undone: GGUF row h*hd + 2i + j
    is HF row h*hd + j*hd/2 + i)"""
    meta, tensors = gguf_read(gguf)
    a = meta["general.architecture"]
    heads, kv = meta[a + ".attention.head_count"], meta[a + ".attention.head_count_kv"]
    names = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
             "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
             "ffn_gate_inp": "mlp.gate"}
    experts = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
    out = []
    for g, (t, ne, raw) in tensors.items():
        v = {0: lambda r: np.frombuffer(r, "<f4"), 8: q8_0_to_f32}[t](raw)
        shape = list(reversed(ne))
        v = v.reshape(shape)
        parts = []
        if g == "token_embd.weight":
            parts = [("model.embed_tokens.weight", v)]
        elif g == "output_norm.weight":
            parts = [("model.norm.weight", v)]
        elif g == "output.weight":
            parts = [("lm_head.weight", v)]
        else:
            _, layer, kind, _ = g.split(".")
            p = f"model.layers.{layer}."
            if kind in experts:
                parts = [(f"{p}mlp.experts.{e}.{experts[kind]}.weight", v[e])
                         for e in range(shape[0])]
            else:
                if a == "llama" and kind in ("attn_q", "attn_k"):
                    n = heads if kind == "attn_q" else kv
                    v = v.reshape(n, shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(shape)
                parts = [(f"{p}{names[kind]}.weight", v)]
        for name, x in parts:
            out.append((name, "F32", list(x.shape), np.ascontiguousarray(x, dtype="<f4").tobytes()))
    os.makedirs(d, exist_ok=True)
    st_write(os.path.join(d, "model.safetensors"), out, {"format": "pt"})
    cfg = {"vocab_size": tensors["token_embd.weight"][1][1],
           "hidden_size": meta[a + ".embedding_length"],
           "intermediate_size": meta[a + ".feed_forward_length"],
           "num_hidden_layers": meta[a + ".block_count"], "num_attention_heads": heads,
           "num_key_value_heads": kv, "rms_norm_eps": meta[a + ".attention.layer_norm_rms_epsilon"],
           "rope_theta": meta[a + ".rope.freq_base"],
           "max_position_embeddings": meta[a + ".context_length"],
           "tie_word_embeddings": "output.weight" not in tensors, "torch_dtype": "float32"}
    if a == "llama":
        cfg.update({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    else:
        cfg.update({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                    "num_experts": meta[a + ".expert_count"],
                    "num_experts_per_tok": meta[a + ".expert_used_count"],
                    "moe_intermediate_size": meta[a + ".expert_feed_forward_length"],
                    "head_dim": meta[a + ".attention.key_length"], "norm_topk_prob": True})
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"), indent=1)


QWEN35_NAMES = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
                "ssm_alpha": "linear_attn.in_proj_a", "ssm_beta": "linear_attn.in_proj_b",
                "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm",
                "ssm_out": "linear_attn.out_proj", "attn_q": "self_attn.q_proj",
                "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
                "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj",
                "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
QWEN35_MTP = {"nextn.eh_proj": "mtp.fc", "nextn.enorm": "mtp.pre_fc_norm_embedding",
              "nextn.hnorm": "mtp.pre_fc_norm_hidden", "nextn.shared_head_norm": "mtp.norm"}


def qwen35_from_gguf(gguf, d, undo=("norm", "a_log", "v_heads")):
    """A Qwen3_5ForConditionalGeneration checkpoint (F32, model.language_model.* names, the MTP
    block as mtp.*, a vision tower the converter leaves out) of a qwen35 GGUF, written from
    what Hugging Face's Qwen3.5 stores and the converter (conversion/qwen.py: Qwen3NextModel,
    _LinearAttentionVReorderBase, _Qwen35MtpMixin) changes, each change undone here: norms
    stored as w - 1 (HF scales by 1 + w; not the linear attention's gated norm), A_log = log(-A),
    conv1d [channels][1][kernel], and the value heads of the linear attention in HF's grouped
    order (those of key head 0 first) instead of ggml's tiled one. `undo` lists the changes
    undone: leaving one out writes a checkpoint the converter would misread (the test's proof
    that each one matters)."""
    meta, tensors = gguf_read(gguf)
    a = "qwen35"
    n_mtp = meta.get(a + ".nextn_predict_layers", 0)
    n_layer = meta[a + ".block_count"] - n_mtp
    nk, nv = meta[a + ".ssm.group_count"], meta[a + ".ssm.time_step_rank"]
    dk, dv = meta[a + ".ssm.state_size"], meta[a + ".ssm.inner_size"] // nv

    def grouped(x, axis, first, c):
        """ggml's tiled value heads [nv/nk][nk][c] from index `first` on, back to [nk][nv/nk][c]"""
        if "v_heads" not in undo or nk == nv:
            return x
        x = np.moveaxis(x, axis, 0)
        head, tail = x[:first], x[first:]
        tail = tail.reshape(nv // nk, nk, c, *tail.shape[1:]).swapaxes(0, 1).reshape(tail.shape)
        return np.moveaxis(np.concatenate([head, tail]), 0, axis)

    out = [("model.visual.blocks.0.attn.qkv.weight", "F32", [8, 4], np.zeros(32, "<f4").tobytes())]
    for g, (t, ne, raw) in tensors.items():
        need(t == 0, f"{g}: type {t}, not F32")
        v = np.frombuffer(raw, "<f4").reshape(list(reversed(ne))).copy()
        if g == "token_embd.weight":
            name = "model.language_model.embed_tokens.weight"
        elif g == "output_norm.weight":
            name = "model.language_model.norm.weight"
        elif g == "output.weight":
            name = "lm_head.weight"
        else:
            _, layer, kind = g.split(".", 2)
            kind = kind.rsplit(".", 1)[0]
            layer = int(layer)
            if layer >= n_layer:
                p = f"mtp.layers.{layer - n_layer}."
            else:
                p = f"model.language_model.layers.{layer}."
            if kind in QWEN35_MTP:
                name = QWEN35_MTP[kind] + ".weight"
            elif kind == "ssm_a":
                name = p + "linear_attn.A_log"
                if "a_log" in undo:
                    v = np.log(-v)
                v = grouped(v, 0, 0, 1)
            elif kind == "ssm_dt":
                name = p + "linear_attn.dt_bias"
                v = grouped(v, 0, 0, 1)
            else:
                name = p + QWEN35_NAMES[kind] + ".weight"
                if kind in ("attn_qkv", "ssm_conv1d"):
                    v = grouped(v, 0, 2 * nk * dk, dv)
                elif kind == "attn_gate":
                    v = grouped(v, 0, 0, dv)
                elif kind in ("ssm_alpha", "ssm_beta"):
                    v = grouped(v, 0, 0, 1)
                elif kind == "ssm_out":
                    v = grouped(v, 1, 0, dv)
                if kind == "ssm_conv1d":
                    v = v[:, None, :]
            if kind.endswith("norm") and kind != "ssm_norm" and "norm" in undo:
                v = v - np.float32(1)
        if g == "output_norm.weight" and "norm" in undo:
            v = v - np.float32(1)
        out.append((name, "F32", list(v.shape), np.ascontiguousarray(v, dtype="<f4").tobytes()))
    os.makedirs(d, exist_ok=True)
    st_write(os.path.join(d, "model.safetensors"), out, {"format": "pt"})
    hd = meta[a + ".attention.key_length"]
    text = {"model_type": "qwen3_5_text", "vocab_size": tensors["token_embd.weight"][1][1],
            "hidden_size": meta[a + ".embedding_length"],
            "intermediate_size": meta[a + ".feed_forward_length"],
            "num_hidden_layers": n_layer, "mtp_num_hidden_layers": n_mtp,
            "num_attention_heads": meta[a + ".attention.head_count"],
            "num_key_value_heads": meta[a + ".attention.head_count_kv"], "head_dim": hd,
            "rms_norm_eps": meta[a + ".attention.layer_norm_rms_epsilon"],
            "max_position_embeddings": meta[a + ".context_length"],
            "full_attention_interval": meta[a + ".full_attention_interval"],
            "layer_types": ["full_attention" if (i + 1) % meta[a + ".full_attention_interval"] == 0
                            else "linear_attention" for i in range(n_layer)],
            "linear_conv_kernel_dim": meta[a + ".ssm.conv_kernel"],
            "linear_key_head_dim": dk, "linear_value_head_dim": dv,
            "linear_num_key_heads": nk, "linear_num_value_heads": nv,
            "rope_parameters": {"rope_type": "default", "rope_theta": meta[a + ".rope.freq_base"],
                                "mrope_section": meta[a + ".rope.dimension_sections"][:3],
                                "mrope_interleaved": True,
                                "partial_rotary_factor": meta[a + ".rope.dimension_count"] / hd},
            "tie_word_embeddings": "output.weight" not in tensors}
    cfg = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
           "text_config": text, "vision_config": {"depth": 1}, "torch_dtype": "float32"}
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"), indent=1)


def w4a16_twins(src, w4_dir, f32_dir):
    """From an F32 checkpoint SRC: W4A16_DIR, its 2-D weights (not embeddings, head, norms or
    conv1d) quantized as compressed-tensors pack-quantized modules (bf16 scale max|w| / 7 per
    group of 32, level round(w / scale) in -8..7), and F32_DIR, the same checkpoint with those
    modules' values scale x level at F32; the rest copied to both"""
    t = st_read_dir(src)
    w4, f32, ignore = [], [], []
    for name, (dt, shape, raw) in t.items():
        quant = (dt == "F32" and len(shape) == 2 and shape[1] % GROUP == 0 and
                 name.endswith(".weight") and "norm" not in name and "embed" not in name and
                 "conv1d" not in name and not name.startswith("lm_head"))
        if not quant:
            w4.append((name, dt, shape, raw))
            f32.append((name, dt, shape, raw))
            ignore.append(name[:-len(".weight")])
            continue
        rows, cols = shape
        g = np.frombuffer(raw, "<f4").reshape(-1, GROUP)
        peak = np.abs(g).max(axis=1)
        scale = bf16_to_f32(f32_to_bf16_bits(np.where(peak > 0, peak / 7, 1)).tobytes())
        lv = np.clip(np.rint(g / scale[:, None]), -8, 7).astype(np.int8)
        vals = (lv.astype(np.float32) * scale[:, None]).astype("<f4")
        f32.append((name, "F32", shape, vals.tobytes()))
        u = (lv.reshape(rows, cols).astype(np.int32) + 8).astype(np.uint32)
        packed = np.zeros((rows, cols // 8), dtype=np.uint32)
        for i in range(8):
            packed |= u[:, i::8] << np.uint32(4 * i)
        mod = name[:-len(".weight")]
        w4 += [(mod + ".weight_packed", "I32", [rows, cols // 8], packed.astype("<u4").tobytes()),
               (mod + ".weight_scale", "BF16", [rows, cols // GROUP],
                f32_to_bf16_bits(scale).astype("<u2").tobytes()),
               (mod + ".weight_shape", "I64", [2], np.array([rows, cols], "<i8").tobytes())]
    cfg = json.load(open(os.path.join(src, "config.json")))
    for d, ts in ((w4_dir, w4), (f32_dir, f32)):
        os.makedirs(d, exist_ok=True)
        st_write(os.path.join(d, "model.safetensors"), ts, {"format": "pt"})
        if d == w4_dir:
            cfg["quantization_config"] = {
                "quant_method": "compressed-tensors", "format": "pack-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                    "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": GROUP}}}, "ignore": ignore}
        json.dump(cfg, open(os.path.join(d, "config.json"), "w"), indent=1)


def q4_0_to_f32(raw):
    """ggml's Q4_0: blocks of an f16 scale and 32 nibbles (low halves first), value = d x (q - 8)"""
    b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 18)
    d = b[:, :2].copy().view("<f2").astype(np.float32)
    q = np.concatenate([b[:, 2:] & 15, b[:, 2:] >> 4], axis=1).astype(np.float32) - 8
    return (d * q).reshape(-1)


def same_gguf(a, b):
    """two GGUFs with the same tensors (names, shapes) and values (F32 or Q4_0 decoded here)"""
    _, ta = gguf_read(a)
    _, tb = gguf_read(b)
    need(set(ta) == set(tb), f"tensor names differ: {sorted(set(ta) ^ set(tb))[:6]}")
    decode = {0: lambda r: np.frombuffer(r, "<f4"), 2: q4_0_to_f32}
    for name in ta:
        need(ta[name][1] == tb[name][1], f"{name}: shape {ta[name][1]} vs {tb[name][1]}")
        x, y = decode[ta[name][0]](ta[name][2]), decode[tb[name][0]](tb[name][2])
        bad = np.nonzero(x != y)[0]
        need(len(bad) == 0, f"{name}: value {bad[:1]} is {x[bad[:1]]} vs {y[bad[:1]]}")


def check_w4a16(src, out):
    exp = json.load(open(os.path.join(src, "expected.json")))
    s = st_read_dir(src)
    o = st_read_dir(out)
    shapes = {n: sh for n, sh, _ in tensor_list()}
    used = 0
    off = exp["offgrid_tensors"]
    for name in exp["copied"] + list(off):
        need(name in o, f"copied tensor {name} missing")
        need(o[name] == s[name], f"copied tensor {name} differs")
        used += 1
    for name in exp["quantized"]:
        if name in off:
            continue
        shape = shapes[name]
        lv_all = levels_of(src, name, shape)
        src_vals = bf16_to_f32(s[name][2])
        cols = shape[-1]
        for mod, r0, nr in modules_of(name, shape):
            pk, sc, sh = (o.get(mod + ".weight_packed"), o.get(mod + ".weight_scale"),
                          o.get(mod + ".weight_shape"))
            need(pk and sc and sh, f"module {mod}: packed/scale/shape missing")
            used += 3
            need(pk[0] == "I32" and pk[1] == (nr, cols // 8), f"{mod}: weight_packed {pk[:2]}")
            need(sc[0] == "BF16" and sc[1] == (nr, cols // GROUP), f"{mod}: weight_scale {sc[:2]}")
            # int64: compressed-tensors stores torch.tensor(weight.shape)
            need(sh[0] == "I64" and list(np.frombuffer(sh[2], "<i8")) == [nr, cols],
                 f"{mod}: weight_shape")
            lv = unpack_int4(pk[2], nr, cols).reshape(-1, GROUP)
            g0, g1 = r0 * cols // GROUP, (r0 + nr) * cols // GROUP
            bad = np.nonzero((lv != lv_all[g0:g1]).any(axis=1))[0]
            need(len(bad) == 0, f"{mod}: group {bad[:1]} levels differ from the generated ones")
            scale = bf16_to_f32(sc[2])
            check_group_values(src_vals.reshape(-1, GROUP)[g0:g1], lv, scale, mod)
    need(used == len(o), f"output holds {len(o)} tensors, {used} accounted for")
    q = json.load(open(os.path.join(out, "config.json")))["quantization_config"]
    w = q["config_groups"]["group_0"]["weights"]
    need(q["quant_method"] == "compressed-tensors" and q["format"] == "pack-quantized",
         "quantization_config: method / format")
    need(w["num_bits"] == 4 and w["group_size"] == 32 and w["symmetric"] and w["strategy"] == "group",
         "quantization_config: weights")
    for name in off:
        mod = name[:-len(".weight")] if name.endswith(".weight") else name
        need(mod in q["ignore"], f"off-grid module {mod} not in ignore")
    need(os.path.exists(os.path.join(out, "tokenizer_config.json")), "tokenizer_config.json not copied")


GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
                11: "<q", 12: "<d"}


def gguf_read(path):
    """metadata {key: value}, tensors {name: (type, ne, data)}: GGUF v3 from its description"""
    data = open(path, "rb").read()
    pos = 0

    def take(fmt):
        nonlocal pos
        v = struct.unpack_from(fmt, data, pos)[0]
        pos += struct.calcsize(fmt)
        return v

    def string():
        nonlocal pos
        n = take("<Q")
        s = data[pos:pos + n].decode()
        pos += n
        return s

    def value(t):
        if t in GGUF_SCALARS:
            return take(GGUF_SCALARS[t])
        if t == 8:
            return string()
        et, n = take("<I"), take("<Q")
        return [value(et) for _ in range(n)]

    need(data[:4] == b"GGUF", "not a GGUF")
    pos = 4
    take("<I")
    nt, nkv = take("<Q"), take("<Q")
    meta = {}
    for _ in range(nkv):
        k = string()
        meta[k] = value(take("<I"))
    infos = []
    for _ in range(nt):
        name = string()
        nd = take("<I")
        ne = [take("<Q") for _ in range(nd)]
        infos.append((name, ne, take("<I"), take("<Q")))
    align = meta.get("general.alignment", 32)
    start = (pos + align - 1) // align * align
    sizes = {0: (1, 4), 30: (1, 2), 2: (32, 18), 1: (1, 2), 8: (32, 34)}
    tensors = {}
    for name, ne, t, off in infos:
        bv, bb = sizes[t]
        n = int(np.prod(ne))
        tensors[name] = (t, ne, data[start + off:start + off + n // bv * bb])
    return meta, tensors


def hf_to_gguf(name):
    """the converter's names for gemma4 (tensor_mapping.py), written out here independently"""
    p = "model.language_model."
    if not name.startswith(p):
        return None
    n = name[len(p):]
    if n == "embed_tokens.weight":
        return "token_embd.weight"
    if n == "norm.weight":
        return "output_norm.weight"
    l, rest = n.split(".")[1], ".".join(n.split(".")[2:])
    m = {"input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "attn_q",
         "self_attn.k_proj.weight": "attn_k", "self_attn.v_proj.weight": "attn_v",
         "self_attn.o_proj.weight": "attn_output", "self_attn.q_norm.weight": "attn_q_norm",
         "self_attn.k_norm.weight": "attn_k_norm",
         "post_attention_layernorm.weight": "post_attention_norm",
         "pre_feedforward_layernorm.weight": "ffn_norm",
         "post_feedforward_layernorm.weight": "post_ffw_norm",
         "post_feedforward_layernorm_1.weight": "post_ffw_norm_1",
         "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2",
         "post_feedforward_layernorm_2.weight": "post_ffw_norm_2",
         "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up",
         "mlp.down_proj.weight": "ffn_down", "router.proj.weight": "ffn_gate_inp",
         "experts.gate_up_proj": "ffn_gate_up_exps", "experts.down_proj": "ffn_down_exps",
         "layer_scalar": "layer_output_scale"}
    if rest == "router.scale":
        return f"blk.{l}.ffn_gate_inp.scale"
    if rest == "router.per_expert_scale":
        return f"blk.{l}.ffn_down_exps.scale"
    return f"blk.{l}.{m[rest]}.weight"


def check_gguf(src, out, fixture, with_vocab=False):
    exp = json.load(open(os.path.join(src, "expected.json")))
    fx = json.load(open(fixture))
    s = st_read_dir(src)
    meta, tensors = gguf_read(out)
    shapes = {n: sh for n, sh, _ in tensor_list()}
    off = exp["offgrid_tensors"]
    # token_embd keeps len(tokenizer.json vocab) + len(added_tokens) rows (Gemma3Model)
    keep = VOCAB
    tj = os.path.join(src, "tokenizer.json")
    if os.path.exists(tj):
        t = json.load(open(tj))
        keep = min(VOCAB, len(t["model"]["vocab"]) + len(t.get("added_tokens", [])))
    # names, shapes, types against the llama.cpp-made fixture
    want = {t["name"]: dict(t) for t in fx["tensors"]}
    want["token_embd.weight"]["ne"] = [D, keep]
    need(set(want) == set(tensors), f"tensor names differ: {sorted(set(want) ^ set(tensors))[:6]}")
    for name, t in want.items():
        typ, ne, _ = tensors[name]
        need(list(ne) == t["ne"], f"{name}: ne {ne} != {t['ne']}")
        src_name = next((h for h in s if hf_to_gguf(h) == name), None)
        expect = {"F32": 0, "Q4_0": 2}[t["type"]]
        if name == "token_embd.weight":
            expect = 30  # embeddings are copied at bf16 (the fixture's --pure quantized them)
        if src_name in off:
            expect = 30
        need(typ == expect, f"{name}: type {typ}, expected {expect}")
    for k, v in fx["metadata"].items():
        if k.startswith("tokenizer."):
            continue
        need(k in meta, f"metadata key {k} missing")
        if isinstance(v, float):
            need(abs(meta[k] - v) <= 1e-6 * abs(v), f"{k}: {meta[k]} != {v}")
        else:
            need(meta[k] == v, f"{k}: {meta[k]} != {v}")
    if with_vocab:  # the tokenizer keys of the fixture GGUF itself, value for value
        fmeta, _ = gguf_read(fixture[:-len(".json")] + ".gguf")
        need(set(meta) == set(fmeta), f"metadata keys differ: {sorted(set(meta) ^ set(fmeta))}")
        for k, v in fmeta.items():
            if k.startswith("tokenizer."):
                need(meta[k] == v, f"{k} differs from the fixture's")
    else:
        need(not [k for k in meta if k not in fx["metadata"] and k != "general.alignment"],
             "extra metadata keys")
    # values
    for hf, (dt, shape, raw) in s.items():
        name = hf_to_gguf(hf)
        if name is None:
            continue
        typ, ne, data = tensors[name]
        src_vals = bf16_to_f32(raw)
        if typ == 2:
            b = np.frombuffer(data, dtype=np.uint8).reshape(-1, 18)
            d = b[:, :2].copy().view("<f2").astype(np.float32).reshape(-1)
            q = np.zeros((len(b), 32), dtype=np.int8)
            q[:, :16] = (b[:, 2:] & 15).astype(np.int8) - 8
            q[:, 16:] = (b[:, 2:] >> 4).astype(np.int8) - 8
            lv = levels_of(src, hf, shapes[hf])
            bad = np.nonzero((q != lv).any(axis=1))[0]
            need(len(bad) == 0, f"{name}: group {bad[:1]} levels differ from the generated ones")
            check_group_values(src_vals.reshape(-1, GROUP), q, d, name)
        elif typ == 0:
            need(np.frombuffer(data, "<f4").tobytes() == src_vals.tobytes(), f"{name}: F32 values")
        else:
            need(data == raw[:len(data)] and len(data) == len(raw) // shape[0] * ne[-1],
                 f"{name}: BF16 bytes differ")
    rf = np.frombuffer(tensors["rope_freqs.weight"][2], "<f4")
    need(list(rf) == [1.0] * 8 + [np.float32(1e30)] * 24, "rope_freqs")


def dequant_w4a16(out, module, f32_path):
    """compressed-tensors' decompression of one module (unpack_from_int32, then x_q * scale)"""
    o = st_read_dir(out)
    rows, cols = (int(x) for x in np.frombuffer(o[module + ".weight_shape"][2], "<i8"))
    q = unpack_int4(o[module + ".weight_packed"][2], rows, cols).astype(np.float32)
    scale = bf16_to_f32(o[module + ".weight_scale"][2]).reshape(rows, cols // GROUP)
    (q * np.repeat(scale, GROUP, axis=1)).astype("<f4").tofile(f32_path)


def make_dtypes(path, f32_path):
    rng = np.random.default_rng(7)
    ts, vals = [], []

    def add(name, dtype, arr, raw, values):
        ts.append((name, dtype, arr, raw))
        vals.append(np.asarray(values, dtype=np.float32).reshape(-1))

    x = rng.standard_normal(24).astype(np.float32)
    add("f32", "F32", (4, 6), x.astype("<f4").tobytes(), x)
    add("f16", "F16", (2, 3, 4), x.astype("<f2").tobytes(), x.astype(np.float16))
    b = f32_to_bf16_bits(x)
    add("bf16", "BF16", (24,), b.astype("<u2").tobytes(), bf16_to_f32(b.tobytes()))
    add("f64", "F64", (3, 8), x.astype("<f8").tobytes(), x.astype(np.float64))
    f8 = np.arange(256, dtype=np.uint8)
    f8 = f8[(f8 & 0x7F) != 0x7F]  # leave NaN out: NaN != NaN
    add("f8_e4m3", "F8_E4M3", (len(f8),), f8.tobytes(), f8_e4m3_to_f32(f8.tobytes()))
    i = rng.integers(-128, 128, size=16)
    add("i8", "I8", (16,), i.astype("<i1").tobytes(), i)
    add("u8", "U8", (2, 8), (i + 128).astype("<u1").tobytes(), i + 128)
    add("i16", "I16", (16,), (i * 200).astype("<i2").tobytes(), i * 200)
    add("i32", "I32", (4, 4), (i * 100000).astype("<i4").tobytes(), i * 100000)
    add("i64", "I64", (16,), (i * 1000).astype("<i8").tobytes(), i * 1000)
    add("scalar", "F32", (), np.float32(2.5).tobytes(), [2.5])
    add("empty", "F32", (0, 5), b"", [])
    st_write(path, ts, {"format": "pt", "note": "dtypes"})
    np.concatenate(vals).astype("<f4").tofile(f32_path)


def read_print(path):
    t, meta = st_read(path)
    print(json.dumps(meta, sort_keys=True))
    for name in sorted(t):
        dt, shape, raw = t[name]
        if dt == "F32":
            v = np.frombuffer(raw, "<f4").astype(np.float64)
        elif dt == "BF16":
            v = bf16_to_f32(raw).astype(np.float64)
        elif dt == "I32":
            v = np.frombuffer(raw, "<i4").astype(np.float64)
        else:
            v = np.frombuffer(raw, np.uint8).astype(np.float64)
        print(name, dt, list(shape), repr(float(v.sum())))


def main():
    a = sys.argv[1:]
    try:
        if a[0] == "qat":
            seed = int(a[a.index("--seed") + 1]) if "--seed" in a else 1
            if "--embed-std" in a:
                EMBED_STD[0] = float(a[a.index("--embed-std") + 1])
            make_qat(a[1], seed, "--offgrid" in a)
            if "--tokenizer" in a:
                add_tokenizer(a[1], int(a[a.index("--tokenizer") + 1]), 4)
            if "--bpe-tokenizer" in a:
                add_bpe_tokenizer(a[1], int(a[a.index("--bpe-tokenizer") + 1]))
        elif a[0] == "check-w4a16":
            check_w4a16(a[1], a[2])
        elif a[0] == "hf-from-gguf":
            hf_from_gguf(a[1], a[2])
        elif a[0] == "qwen35-from-gguf":
            keep = [k for k in ("norm", "a_log", "v_heads")
                    if "--keep-" + k.replace("_", "-") not in a]
            paths = [x for x in a[1:] if not x.startswith("--")]
            qwen35_from_gguf(paths[0], paths[1], keep)
        elif a[0] == "w4a16-twins":
            w4a16_twins(a[1], a[2], a[3])
        elif a[0] == "same-gguf":
            same_gguf(a[1], a[2])
        elif a[0] == "set-scale":
            set_scale(a[1], a[2], float(a[3]))
        elif a[0] == "check-view":
            check_view(a[1], a[2], a[3])
        elif a[0] == "check-gguf":
            check_gguf(a[1], a[2], a[3], "--vocab" in a)
        elif a[0] == "dequant-w4a16":
            dequant_w4a16(a[1], a[2], a[3])
        elif a[0] == "dtypes":
            make_dtypes(a[1], a[2])
        elif a[0] == "read":
            read_print(a[1])
        else:
            raise Fail("unknown command " + a[0])
    except Fail as e:
        print("FAIL:", e)
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""An independent float64 forward of the `gemma4` architecture, from an F32 GGUF.

Computes the logits of a token sequence (one prefill, every position) under the semantics of
llama.cpp's src/models/gemma4.cpp, with numpy in float64 and the exact tanh-GELU. It reads the
model file only; it never sees what moe computes. Both forms: routed experts beside the dense
MLP (26B-A4B), or the dense MLP alone (31B).

- embeddings x sqrt(n_embd); per layer: RMSNorm(attn_norm) -> q, k, v (v = the raw k projection
  without attn_v); q, k RMSNormed per head by attn_q_norm / attn_k_norm, v per head without a
  weight; NEOX rope (sliding layers: their own dims and rope.freq_base_swa; full layers: angles
  divided by rope_freqs); scores q . k (scale 1), causal, sliding layers see the last
  sliding_window positions; output projection, RMSNorm(post_attention_norm), + residual;
- FFN of a MoE layer: GELU MLP on RMSNorm(ffn_norm) normed by post_ffw_norm_1, plus the experts
  on RMSNorm(pre_ffw_norm_2): router ffn_gate_inp . (RMSNorm(x) / sqrt(n_embd) * ffn_gate_inp.scale),
  softmax, top-k renormalised, each expert GELU(gate) * up from ffn_gate_up_exps (gate rows
  first), down, times ffn_down_exps.scale[e], summed and normed by post_ffw_norm_2; the sum of
  the two normed by post_ffw_norm; dense layers: the MLP normed by post_ffw_norm;
- + the attention output, x layer_output_scale; output_norm; tied or untied head; logits
  softcapped: cap * tanh(logits / cap).

Usage: gemma4_reference.py MODEL.gguf IDS OUT.f32 (IDS comma-separated); writes
[n_tokens][n_vocab] float32.
"""
import struct
import sys

import numpy as np

# ==== GGUF reader (version 3, F32 tensors) ====

SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}


class Reader:
    def __init__(self, data):
        self.data, self.pos = data, 0

    def take(self, fmt):
        v = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return v[0]

    def string(self):
        n = self.take("<Q")
        s = self.data[self.pos:self.pos + n].decode()
        self.pos += n
        return s

    def value(self, t):
        if t == 8:
            return self.string()
        if t == 9:
            et, n = self.take("<I"), self.take("<Q")
            return [self.value(et) for _ in range(n)]
        return self.take(SCALARS[t])


def read_gguf(path):
    data = open(path, "rb").read()
    r = Reader(data)
    assert data[:4] == b"GGUF", path
    r.pos = 4
    assert r.take("<I") == 3
    n_tensors, n_kv = r.take("<Q"), r.take("<Q")
    kv = {}
    for _ in range(n_kv):
        key = r.string()
        kv[key] = r.value(r.take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = r.string()
        ne = [r.take("<Q") for _ in range(r.take("<I"))]
        ttype, offset = r.take("<I"), r.take("<Q")
        assert ttype == 0, f"{name}: this reader takes F32 tensors only"
        infos.append((name, ne, offset))
    align = kv.get("general.alignment", 32)
    base = (r.pos + align - 1) // align * align
    tensors = {}
    for name, ne, offset in infos:
        n = int(np.prod(ne))
        arr = np.frombuffer(data, "<f4", n, base + offset).astype(np.float64)
        tensors[name] = arr.reshape(list(reversed(ne)))  # numpy shape = reversed ggml ne
    return kv, tensors


# ==== The forward pass ====


def rms_norm(x, w, eps):
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y * w if w is not None else y


def gelu(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def rope_neox(x, pos, n_dims, base, freq_factors):
    """x: [n_tok][n_heads][head_dim]; rotates pairs (i, i + n_dims / 2) of the first n_dims."""
    half = n_dims // 2
    inv = base ** (-2.0 * np.arange(half) / n_dims)
    if freq_factors is not None:
        inv = inv / freq_factors[:half]
    ang = pos[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = x.copy()
    a, b = x[..., :half], x[..., half:n_dims]
    out[..., :half] = a * cos - b * sin
    out[..., half:n_dims] = a * sin + b * cos
    return out


def forward(kv, t, ids):
    g = lambda k, d=None: kv.get("gemma4." + k, d)
    n_embd, n_layer, n_head = g("embedding_length"), g("block_count"), g("attention.head_count")
    eps = g("attention.layer_norm_rms_epsilon")
    head_kv = g("attention.head_count_kv")
    head_kv = head_kv if isinstance(head_kv, list) else [head_kv] * n_layer
    swa = g("attention.sliding_window_pattern")
    hd_full, hd_swa = g("attention.key_length"), g("attention.key_length_swa")
    rot_full = g("rope.dimension_count", hd_full)
    rot_swa = g("rope.dimension_count_swa", hd_swa)
    base_full, base_swa = g("rope.freq_base"), g("rope.freq_base_swa")
    window, cap = g("attention.sliding_window"), g("final_logit_softcapping", 0.0)
    n_used = g("expert_used_count", 0)
    n_tok = len(ids)
    pos = np.arange(n_tok, dtype=np.float64)
    x = t["token_embd.weight"][ids] * np.sqrt(np.float32(n_embd))
    for il in range(n_layer):
        p = lambda name: t.get(f"blk.{il}.{name}")
        sliding = bool(swa[il])
        hd, n_kv = (hd_swa if sliding else hd_full), head_kv[il]
        h = rms_norm(x, p("attn_norm.weight"), eps)
        q = (h @ p("attn_q.weight").T).reshape(n_tok, n_head, hd)
        k = (h @ p("attn_k.weight").T).reshape(n_tok, n_kv, hd)
        wv = p("attn_v.weight")
        v = (h @ wv.T).reshape(n_tok, n_kv, hd) if wv is not None else k.copy()
        q = rms_norm(q, p("attn_q_norm.weight"), eps)
        k = rms_norm(k, p("attn_k_norm.weight"), eps)
        v = rms_norm(v, None, eps)
        ff = None if sliding else t["rope_freqs.weight"]
        q = rope_neox(q, pos, rot_swa if sliding else rot_full, base_swa if sliding else base_full,
                      ff)
        k = rope_neox(k, pos, rot_swa if sliding else rot_full, base_swa if sliding else base_full,
                      ff)
        att = np.zeros((n_tok, n_head, hd))
        for i in range(n_tok):
            first = max(0, i - window + 1) if sliding else 0
            for hh in range(n_head):
                kh = hh // (n_head // n_kv)
                s = k[first:i + 1, kh] @ q[i, hh]  # scale 1
                w = np.exp(s - s.max())
                att[i, hh] = (w / w.sum()) @ v[first:i + 1, kh]
        o = att.reshape(n_tok, n_head * hd) @ p("attn_output.weight").T
        a = rms_norm(o, p("post_attention_norm.weight"), eps) + x
        hm = rms_norm(a, p("ffn_norm.weight"), eps)
        mlp = (gelu(hm @ p("ffn_gate.weight").T) * (hm @ p("ffn_up.weight").T)) @ \
            p("ffn_down.weight").T
        if p("ffn_gate_inp.weight") is not None:
            mlp = rms_norm(mlp, p("post_ffw_norm_1.weight"), eps)
            r_in = rms_norm(a, None, eps) / np.sqrt(n_embd) * p("ffn_gate_inp.scale")
            logits = r_in @ p("ffn_gate_inp.weight").T
            prob = np.exp(logits - logits.max(axis=1, keepdims=True))
            prob /= prob.sum(axis=1, keepdims=True)
            he = rms_norm(a, p("pre_ffw_norm_2.weight"), eps)
            gate_up, down = p("ffn_gate_up_exps.weight"), p("ffn_down_exps.weight")
            n_ff = down.shape[2]
            dscale = p("ffn_down_exps.scale")
            moe = np.zeros_like(a)
            for i in range(n_tok):
                top = np.argsort(-prob[i], kind="stable")[:n_used]
                wts = prob[i, top] / prob[i, top].sum()
                for e, we in zip(top, wts):
                    gu = gate_up[e] @ he[i]
                    y = down[e] @ (gelu(gu[:n_ff]) * gu[n_ff:])
                    moe[i] += we * y * (dscale[e] if dscale is not None else 1.0)
            mlp = mlp + rms_norm(moe, p("post_ffw_norm_2.weight"), eps)
        x = rms_norm(mlp, p("post_ffw_norm.weight"), eps) + a
        if p("layer_output_scale.weight") is not None:
            x = x * p("layer_output_scale.weight")[0]
    h = rms_norm(x, t["output_norm.weight"], eps)
    head = t.get("output.weight", t["token_embd.weight"])
    logits = h @ head.T
    return cap * np.tanh(logits / cap) if cap else logits


def main():
    kv, tensors = read_gguf(sys.argv[1])
    ids = [int(s) for s in sys.argv[2].split(",")]
    forward(kv, tensors, ids).astype("<f4").tofile(sys.argv[3])


if __name__ == "__main__":
    main()

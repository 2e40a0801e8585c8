#!/usr/bin/env python3
"""An independent float64 reference for the `glm-dsa` architecture (GLM-5 / 5.1 / 5.2).

Writes a small random glm-dsa GGUF (F32 tensors, llama.cpp's tensor names, keys and ggml shape
order) and the logits of a token sequence under the semantics of llama.cpp's src/models/
glm-dsa.cpp, computed here with numpy in float64 from the weights it generated (it never reads
what moe computes):

- MLA as DeepSeek-V3: q LoRA, latent cache normed, key rope part roped (NORM: adjacent pairs),
  score = (attn_k_b_h^T q_nope_h) . c + q_pe . k_pe, times 1/sqrt(qk_nope + qk_rope);
- the lightning indexer of "full" layers: queries attn_q_b . qr, keys LayerNorm(attn_k . x) at
  epsilon 0 with weight and bias, both roped on their first rope dims (NORM); per-token head
  weights proj . x / sqrt(key_length * heads); score(n) = sum_h w_h relu(q_h . k_n); a query at
  position p attends to its top_k positions (all of them while p + 1 <= top_k); "shared" layers
  reuse the last full layer's choice for the same token;
- DeepSeek-V3 routing: sigmoid, top-k by score + exp_probs_b, weights normalised, x scale;
  a shared expert added unweighted; leading dense layers.

Usage: glm_dsa_reference.py OUT_DIR [SEED]. Writes OUT_DIR/glm-dsa.gguf, OUT_DIR/tokens.txt
(comma-separated ids) and OUT_DIR/logits.f32 ([n_tokens][n_vocab] float32), and prints the
smallest indexer selection gap and routing gap (relative), which the seed is chosen to keep
clear of ties.
"""
import struct
import sys

import numpy as np

CFG = dict(n_embd=64, n_layer=4, n_head=2, q_lora=12, kv_lora=16, nope=8, rope=4, v_head=4,
           n_ff=16, n_expert=4, n_used=2, ff_exp=8, n_shared=1, scale=2.5, rms_eps=1e-5,
           idx_heads=8, idx_dim=8, top_k=6, types=[1, 1, 0, 1], n_vocab=64, n_tok=150,
           base=10000.0, ctx=4096)

# ==== GGUF writer (version 3, F32 tensors only) ====

GGUF_U32, GGUF_F32, GGUF_BOOL, GGUF_STRING, GGUF_ARRAY = 4, 6, 7, 8, 9


def _str(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _kv(key, value):
    out = _str(key)
    if isinstance(value, bool):
        return out + struct.pack("<IB", GGUF_BOOL, value)
    if isinstance(value, int):
        return out + struct.pack("<II", GGUF_U32, value)
    if isinstance(value, float):
        return out + struct.pack("<If", GGUF_F32, value)
    if isinstance(value, str):
        return out + struct.pack("<I", GGUF_STRING) + _str(value)
    assert isinstance(value, list) and all(isinstance(v, bool) for v in value)
    return out + struct.pack("<IIQ", GGUF_ARRAY, GGUF_BOOL, len(value)) + bytes(value)


def write_gguf(path, kvs, tensors):
    """tensors: (name, numpy array) with ggml ne = reversed numpy shape."""
    align = 32
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs))
    head += b"".join(_kv(k, v) for k, v in kvs)
    offset, infos, blobs = 0, b"", []
    for name, arr in tensors:
        ne = list(reversed(arr.shape))
        infos += _str(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
        infos += struct.pack("<IQ", 0, offset)  # type 0: F32
        data = np.ascontiguousarray(arr, dtype="<f4").tobytes()
        blobs.append(data)
        offset += (len(data) + align - 1) // align * align
    head += infos
    head += b"\0" * (-len(head) % align)
    with open(path, "wb") as f:
        f.write(head)
        for data in blobs:
            f.write(data + b"\0" * (-len(data) % align))


# ==== The model ====


def make_weights(rng, c):
    E, H = c["n_embd"], c["n_head"]
    hd_q = c["nope"] + c["rope"]

    def mat(n_out, n_in, std=0.02):
        return rng.standard_normal((n_out, n_in)) * std

    def norm(n):
        return 1.0 + rng.standard_normal(n) * 0.05

    w = {"token_embd.weight": rng.standard_normal((c["n_vocab"], E)) * 0.5,
         "output_norm.weight": norm(E), "output.weight": mat(c["n_vocab"], E, 0.1)}
    for il in range(c["n_layer"]):
        p = f"blk.{il}."
        w[p + "attn_norm.weight"] = norm(E)
        w[p + "ffn_norm.weight"] = norm(E)
        w[p + "attn_q_a.weight"] = mat(c["q_lora"], E, 0.15)
        w[p + "attn_q_a_norm.weight"] = norm(c["q_lora"])
        w[p + "attn_q_b.weight"] = mat(H * hd_q, c["q_lora"], 0.4)
        w[p + "attn_kv_a_mqa.weight"] = mat(c["kv_lora"] + c["rope"], E, 0.15)
        w[p + "attn_kv_a_norm.weight"] = norm(c["kv_lora"])
        w[p + "attn_k_b.weight"] = rng.standard_normal((H, c["kv_lora"], c["nope"])) * 0.4
        w[p + "attn_v_b.weight"] = rng.standard_normal((H, c["v_head"], c["kv_lora"])) * 0.3
        w[p + "attn_output.weight"] = mat(E, H * c["v_head"], 0.3)
        if c["types"][il]:
            D, IH = c["idx_dim"], c["idx_heads"]
            w[p + "indexer.attn_q_b.weight"] = mat(IH * D, c["q_lora"], 0.5)
            w[p + "indexer.attn_k.weight"] = mat(D, E, 0.3)
            w[p + "indexer.k_norm.weight"] = norm(D)
            w[p + "indexer.k_norm.bias"] = rng.standard_normal(D) * 0.1
            w[p + "indexer.proj.weight"] = mat(IH, E, 0.3)
        if il == 0:
            w[p + "ffn_gate.weight"] = mat(c["n_ff"], E, 0.1)
            w[p + "ffn_up.weight"] = mat(c["n_ff"], E, 0.1)
            w[p + "ffn_down.weight"] = mat(E, c["n_ff"], 0.1)
        else:
            X, F = c["n_expert"], c["ff_exp"]
            w[p + "ffn_gate_inp.weight"] = mat(X, E, 0.2)
            w[p + "exp_probs_b.bias"] = rng.standard_normal(X) * 0.05
            w[p + "ffn_gate_exps.weight"] = rng.standard_normal((X, F, E)) * 0.1
            w[p + "ffn_up_exps.weight"] = rng.standard_normal((X, F, E)) * 0.1
            w[p + "ffn_down_exps.weight"] = rng.standard_normal((X, E, F)) * 0.1
            S = F * c["n_shared"]
            w[p + "ffn_gate_shexp.weight"] = mat(S, E, 0.1)
            w[p + "ffn_up_shexp.weight"] = mat(S, E, 0.1)
            w[p + "ffn_down_shexp.weight"] = mat(E, S, 0.1)
    # stored as float32: the reference computes with exactly those values
    return {k: v.astype(np.float32).astype(np.float64) for k, v in w.items()}


def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x) + eps) * w


def layernorm(x, w, b):  # epsilon 0, as llama.cpp runs the glm-dsa indexer's k_norm
    m = x.mean()
    return (x - m) / np.sqrt(np.mean((x - m) ** 2)) * w + b


def rope_norm(x, pos, n_dims, base):
    """Rotate adjacent pairs (x[2i], x[2i+1]) of the first n_dims by pos * base^(-2i/n_dims)."""
    x = x.copy()
    for i in range(n_dims // 2):
        theta = pos * base ** (-2.0 * i / n_dims)
        a, b = x[2 * i], x[2 * i + 1]
        x[2 * i], x[2 * i + 1] = a * np.cos(theta) - b * np.sin(theta), a * np.sin(theta) + b * np.cos(theta)
    return x


def silu(x):
    return x / (1.0 + np.exp(-x))


def forward(w, c, tokens):
    E, H, n = c["n_embd"], c["n_head"], len(tokens)
    hd_q, kv, R = c["nope"] + c["rope"], c["kv_lora"], c["rope"]
    scale = 1.0 / np.sqrt(hd_q)
    x = np.array([w["token_embd.weight"][t] for t in tokens])
    gaps = {"indexer": np.inf, "routing": np.inf}
    chosen = [None] * n  # per position, the last full layer's selection
    for il in range(c["n_layer"]):
        p = f"blk.{il}."
        xn = np.array([rms(x[t], w[p + "attn_norm.weight"], c["rms_eps"]) for t in range(n)])
        qr = np.array([rms(w[p + "attn_q_a.weight"] @ xn[t], w[p + "attn_q_a_norm.weight"], c["rms_eps"])
                       for t in range(n)])
        lat, kpe = [], []
        for t in range(n):
            a = w[p + "attn_kv_a_mqa.weight"] @ xn[t]
            lat.append(rms(a[:kv], w[p + "attn_kv_a_norm.weight"], c["rms_eps"]))
            kpe.append(rope_norm(a[kv:], t, R, c["base"]))
        if c["types"][il]:  # the indexer: every position's key, then every query's choice
            D, IH = c["idx_dim"], c["idx_heads"]
            keys = [rope_norm(layernorm(w[p + "indexer.attn_k.weight"] @ xn[t], w[p + "indexer.k_norm.weight"],
                                        w[p + "indexer.k_norm.bias"]), t, R, c["base"]) for t in range(n)]
            for t in range(n):
                q = (w[p + "indexer.attn_q_b.weight"] @ qr[t]).reshape(IH, D)
                q = np.array([rope_norm(q[h], t, R, c["base"]) for h in range(IH)])
                hw = (w[p + "indexer.proj.weight"] @ xn[t]) / np.sqrt(D * IH)
                score = np.array([np.sum(hw * np.maximum(q @ keys[m], 0.0)) for m in range(t + 1)])
                if t + 1 <= c["top_k"]:
                    chosen[t] = list(range(t + 1))
                    continue
                order = sorted(range(t + 1), key=lambda m: (-score[m], m))
                kth, next_ = score[order[c["top_k"] - 1]], score[order[c["top_k"]]]
                gaps["indexer"] = min(gaps["indexer"], (kth - next_) / (np.ptp(score) + 1e-30))
                chosen[t] = sorted(order[:c["top_k"]])
        out = np.zeros((n, E))
        for t in range(n):
            q = (w[p + "attn_q_b.weight"] @ qr[t]).reshape(H, hd_q)
            heads = []
            for h in range(H):
                q_lat = w[p + "attn_k_b.weight"][h] @ q[h, :c["nope"]]
                q_pe = rope_norm(q[h, c["nope"]:], t, R, c["base"])
                cells = chosen[t]
                s = np.array([(q_lat @ lat[m] + q_pe @ kpe[m]) * scale for m in cells])
                pr = np.exp(s - s.max())
                pr /= pr.sum()
                ctx = sum(pr[i] * lat[m] for i, m in enumerate(cells))
                heads.append(w[p + "attn_v_b.weight"][h] @ ctx)
            out[t] = w[p + "attn_output.weight"] @ np.concatenate(heads)
        x = x + out
        for t in range(n):
            xn = rms(x[t], w[p + "ffn_norm.weight"], c["rms_eps"])
            if il == 0:
                y = w[p + "ffn_down.weight"] @ (silu(w[p + "ffn_gate.weight"] @ xn) * (w[p + "ffn_up.weight"] @ xn))
            else:
                prob = 1.0 / (1.0 + np.exp(-(w[p + "ffn_gate_inp.weight"] @ xn)))
                sel = prob + w[p + "exp_probs_b.bias"]
                order = sorted(range(c["n_expert"]), key=lambda e: -sel[e])
                gaps["routing"] = min(gaps["routing"], sel[order[c["n_used"] - 1]] - sel[order[c["n_used"]]])
                use = order[:c["n_used"]]
                wts = prob[use] / prob[use].sum() * c["scale"]
                y = np.zeros(E)
                for e, we in zip(use, wts):
                    g = w[p + "ffn_gate_exps.weight"][e] @ xn
                    u = w[p + "ffn_up_exps.weight"][e] @ xn
                    y += we * (w[p + "ffn_down_exps.weight"][e] @ (silu(g) * u))
                y += w[p + "ffn_down_shexp.weight"] @ (silu(w[p + "ffn_gate_shexp.weight"] @ xn) *
                                                      (w[p + "ffn_up_shexp.weight"] @ xn))
            x[t] = x[t] + y
    logits = np.array([w["output.weight"] @ rms(x[t], w["output_norm.weight"], c["rms_eps"]) for t in range(n)])
    return logits, gaps


def main():
    out_dir = sys.argv[1]
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    c = CFG
    rng = np.random.default_rng(seed)
    w = make_weights(rng, c)
    tokens = [int(t) for t in rng.integers(0, c["n_vocab"], c["n_tok"])]
    logits, gaps = forward(w, c, tokens)
    a = "glm-dsa"
    kvs = [("general.architecture", a), (a + ".block_count", c["n_layer"]),
           (a + ".context_length", c["ctx"]), (a + ".embedding_length", c["n_embd"]),
           (a + ".feed_forward_length", c["n_ff"]), (a + ".attention.head_count", c["n_head"]),
           (a + ".attention.head_count_kv", 1), (a + ".attention.layer_norm_rms_epsilon", c["rms_eps"]),
           (a + ".attention.q_lora_rank", c["q_lora"]), (a + ".attention.kv_lora_rank", c["kv_lora"]),
           (a + ".attention.key_length", c["kv_lora"] + c["rope"]),
           (a + ".attention.value_length", c["kv_lora"]),
           (a + ".attention.key_length_mla", c["nope"] + c["rope"]),
           (a + ".attention.value_length_mla", c["v_head"]), (a + ".rope.dimension_count", c["rope"]),
           (a + ".rope.freq_base", c["base"]), (a + ".expert_count", c["n_expert"]),
           (a + ".expert_used_count", c["n_used"]), (a + ".expert_shared_count", c["n_shared"]),
           (a + ".expert_feed_forward_length", c["ff_exp"]), (a + ".leading_dense_block_count", 1),
           (a + ".expert_gating_func", 2), (a + ".expert_weights_scale", c["scale"]),
           (a + ".expert_weights_norm", True), (a + ".attention.indexer.head_count", c["idx_heads"]),
           (a + ".attention.indexer.key_length", c["idx_dim"]),
           (a + ".attention.indexer.top_k", c["top_k"]),
           (a + ".attention.indexer.types", [bool(t) for t in c["types"]])]
    write_gguf(f"{out_dir}/glm-dsa.gguf", kvs, list(w.items()))
    with open(f"{out_dir}/tokens.txt", "w") as f:
        f.write(",".join(map(str, tokens)))
    logits.astype("<f4").tofile(f"{out_dir}/logits.f32")
    print(f"seed {seed}: indexer gap {gaps['indexer']:.3g} of the score range, routing gap {gaps['routing']:.3g}")


if __name__ == "__main__":
    main()

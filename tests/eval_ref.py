#!/usr/bin/python3
"""Reference computations for tests/test_eval.c, written from the definitions with numpy and
Python's own integers, never from moe's code:

  labels RESULTS.jsonl DIR N_VOCAB
      For record i and label k, DIR/r<i>_l<k>.f32 holds `moe logits` of prompt_ids + label_ids[k]
      (float32 [n][N_VOCAB]); the label's log-probability is the sum over its tokens of the
      log-softmax (float64) of the row before each. Prints {"logprobs": [[...]...], "pred": [...]}.
  compare A.jsonl B.jsonl RESAMPLES SEED
      Paired bootstrap of accuracy(B) - accuracy(A): records paired by (id, reversed) in A's
      order, resampling indices from splitmix64 (Steele, Lea & Flood 2014) seeded with SEED, one
      stream, index = next % n; the interval is numpy.percentile(diffs, [2.5, 97.5]).
  kl MODEL.f32 REF.f32 TOKENS N_VOCAB CTX
      KL(ref || model) per position as llama-perplexity --kl-divergence defines it, for one chunk
      of CTX tokens: positions CTX//2 .. CTX-2 against the token after them.
"""
import json
import sys

import numpy as np

MASK = (1 << 64) - 1


def splitmix64(state):
    while True:
        state = (state + 0x9E3779B97F4A7C15) & MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        yield z ^ (z >> 31)


def log_softmax(rows):
    rows = rows.astype(np.float64)
    m = rows.max(axis=-1, keepdims=True)
    return rows - m - np.log(np.exp(rows - m).sum(axis=-1, keepdims=True))


def labels(results, folder, n_vocab):
    out = {"logprobs": [], "pred": []}
    with open(results) as f:
        lines = [json.loads(l) for l in f if l.strip()]
    for i, r in enumerate(lines):
        n_p = len(r["prompt_ids"])
        sums = []
        for k, ids in enumerate(r["label_ids"]):
            x = np.fromfile(f"{folder}/r{i}_l{k}.f32", dtype=np.float32).reshape(-1, n_vocab)
            assert x.shape[0] == n_p + len(ids), (i, k, x.shape)
            lp = log_softmax(x)
            sums.append(float(sum(lp[n_p - 1 + j, t] for j, t in enumerate(ids))))
        out["logprobs"].append(sums)
        out["pred"].append(int(np.argmax(sums)))
    print(json.dumps(out))


def compare(path_a, path_b, resamples, seed):
    def load(p):
        with open(p) as f:
            return [json.loads(l) for l in f if l.strip()]

    a, b = load(path_a), load(path_b)
    by_key = {(r["id"], r.get("reversed", False)): r for r in b}
    ca, cb, flipped = [], [], []
    for r in a:
        s = by_key.get((r["id"], r.get("reversed", False)))
        if s is None or r["answer"] is None or s["answer"] is None:
            continue
        ca.append(int(r["pred"] == r["answer"]))
        cb.append(int(s["pred"] == s["answer"]))
        if ca[-1] != cb[-1]:
            flipped.append(r["id"] + (" (reversed)" if r.get("reversed") else ""))
    n = len(ca)
    d = np.array(cb, dtype=np.int64) - np.array(ca, dtype=np.int64)
    gen = splitmix64(seed)
    diffs = np.empty(resamples)
    for t in range(resamples):
        idx = np.fromiter((next(gen) % n for _ in range(n)), dtype=np.int64, count=n)
        diffs[t] = d[idx].sum() / n
    lo, hi = np.percentile(diffs, [2.5, 97.5])
    print(json.dumps({"n": n, "accuracy_a": sum(ca) / n, "accuracy_b": sum(cb) / n,
                      "diff": float(d.sum() / n), "lo": float(lo), "hi": float(hi),
                      "flipped": flipped}))


def kl(model_path, ref_path, tokens, n_vocab, ctx):
    toks = [int(t) for t in tokens.split(",")]
    lm = log_softmax(np.fromfile(model_path, dtype=np.float32).reshape(-1, n_vocab)[:ctx])
    lr = log_softmax(np.fromfile(ref_path, dtype=np.float32).reshape(-1, n_vocab)[:ctx])
    rows = range(ctx // 2, ctx - 1)
    kls = np.array([float((np.exp(lr[j]) * (lr[j] - lm[j])).sum()) for j in rows])
    nll = np.array([-lm[j, toks[j + 1]] for j in rows])
    nll_ref = np.array([-lr[j, toks[j + 1]] for j in rows])
    top = np.mean([np.argmax(lm[j]) == np.argmax(lr[j]) for j in rows])
    print(json.dumps({"kl_mean": float(kls.mean()), "kl_median": float(np.median(kls)),
                      "kl_p99": float(np.percentile(kls, 99)), "kl_max": float(kls.max()),
                      "top1_agreement": float(top), "ppl": float(np.exp(nll.mean())),
                      "ppl_ref": float(np.exp(nll_ref.mean())), "scored": len(kls)}))


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "labels":
        labels(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif cmd == "compare":
        compare(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    elif cmd == "kl":
        kl(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
    else:
        sys.exit(f"eval_ref.py: unknown command {cmd}")

#!/usr/bin/python3
"""Regenerate the float rows ggml quantized into ../shared/quant/<TYPE>.blocks.

The fixture set stores the source rows only for some types (<TYPE>.src.f32); for the others its
MANIFEST.json gives the numpy seed (1000 + ggml type id) and each row's recipe (row_desc). This
script follows those recipes with numpy's default_rng(seed), drawing in the order the fixture
generator does, and writes <out_dir>/<TYPE>.src.f32 for every type in the manifest.

Check on the generator: for every type whose source rows ARE stored, the rows written here must
equal them bit for bit, and the script exits 1 if not; for every type the RMS of (ggml's
dequantized rows - these rows) must equal the manifest's rms_dequant_error_vs_src.

usage: quant_sources.py SHARED_QUANT_DIR OUT_DIR
"""
import json
import os
import sys

import numpy as np


def generate(seed, n_rows, n):
    rng = np.random.default_rng(seed)
    out = np.zeros((n_rows, n), dtype=np.float32)
    for r in range(1, n_rows):  # row 0 is all zero and draws nothing
        s = 10 ** rng.uniform(-3, 1)
        if r == n_rows - 1:  # large scale: one N(0,1) row drawn and dropped, then N(0,1)*50
            rng.standard_normal(n)
            out[r] = rng.standard_normal(n) * 50
            continue
        if r == 2:  # positive only: |N(0,1)| * s' + 0.2 s' with s' = s / 2
            s *= 0.5
            out[r] = np.abs(rng.standard_normal(n)) * s + 0.2 * s
            continue
        x = rng.standard_normal(n) * s
        if r == 1:  # every 3rd 32-chunk (c % 3 == 1) and the last 256 values zero
            for c in range(n // 32):
                if c % 3 == 1:
                    x[32 * c:32 * (c + 1)] = 0
            x[n - 256:] = 0
        elif r == 3 or r == n_rows // 2 + 1:  # 10 outliers x U(20,50), random sign
            idx = rng.choice(n, 10, replace=False)
            x[idx] *= rng.uniform(20, 50, 10) * rng.choice([-1, 1], 10)
        elif r % 2 == 0:  # per-32-chunk scale jitter 10^U(-0.7,0.7)
            x = x * np.repeat(10 ** rng.uniform(-0.7, 0.7, n // 32), 32)
        out[r] = x
    return out


def main():
    shared, out_dir = sys.argv[1], sys.argv[2]
    manifest = json.load(open(os.path.join(shared, "MANIFEST.json")))
    bad = []
    for t in manifest["types"]:
        name, n_rows, n = t["type"], t["n_rows"], t["row_len"]
        src = generate(t["seed"], n_rows, n)
        if t.get("src_stored"):
            stored = np.fromfile(os.path.join(shared, name + ".src.f32"), dtype=np.float32)
            if not np.array_equal(stored.reshape(n_rows, n), src):
                bad.append(name + " (differs from the stored .src.f32)")
        deq = np.fromfile(os.path.join(shared, name + ".f32"), dtype=np.float32)
        rms = float(np.sqrt(np.mean((deq.reshape(n_rows, n).astype(np.float64) - src) ** 2)))
        want = t["rms_dequant_error_vs_src"]
        if abs(rms - want) > 1e-12 * max(1.0, abs(want)):
            bad.append("%s (rms %.17g, manifest %.17g)" % (name, rms, want))
        src.tofile(os.path.join(out_dir, name + ".src.f32"))
    if bad:
        print("regenerated rows do not match: " + ", ".join(bad))
        sys.exit(1)


if __name__ == "__main__":
    main()

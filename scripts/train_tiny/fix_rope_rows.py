#!/usr/bin/env python3
"""Rewrites a GGUF written by train.py with the earlier make_fixtures.to_gguf, which permuted the
RoPE rows of GLM's attention and indexer weights (rotate-half -> interleaved pairs). transformers
5.17 runs GLM-MoE-DSA's RoPE interleaved on the checkpoint's own row order, as llama.cpp and the
engine do, so the rows belong unpermuted (make_fixtures.to_gguf no longer permutes them). The bundled
model's training run used the earlier to_gguf; this puts its rows back. Its reference numbers were
computed on from_gguf's inverse permutation, i.e. on the unpermuted weights, and stay valid.

Rows are whole Q8_0 rows (the permutation is over output rows; blocks run along ne0), so the
dequantized values are moved unchanged and the writer re-quantizes them to the same bytes.
Standard library only:
    python3 scripts/train_tiny/fix_rope_rows.py --sparsemla build/sparsemla --metadata gguf_metadata.json \
        --dims config.json IN.gguf OUT.gguf
"""
import argparse
import json
import os
import re
import subprocess
import tempfile


def rope_perm(d):
    """The earlier to_gguf's order: GGUF row 2i <- row i, row 2i+1 <- row i + d/2."""
    return [i // 2 + (i % 2) * (d // 2) for i in range(d)]


def list_tensors(sm, path):
    out = subprocess.run([sm, "inspect", path, "--tensors"], check=True, capture_output=True, text=True).stdout
    rows = []
    for line in out.splitlines():
        m = re.match(r"^(\S+)\s+(\S+)\s+\{([\d, ]+)\}\s", line)
        if m and m.group(1) != "name":
            rows.append((m.group(1), m.group(2), [int(x) for x in m.group(3).split(",")]))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sparsemla", required=True)
    ap.add_argument("--metadata", required=True, help="the metadata list train.py wrote (gguf_metadata.json)")
    ap.add_argument("--dims", required=True, help="the transformers config.json of the model")
    ap.add_argument("src")
    ap.add_argument("dst")
    args = ap.parse_args()
    cfg = json.load(open(args.dims))
    nope, rope, kvl = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["kv_lora_rank"]
    idim = cfg["index_head_dim"]
    perm = rope_perm(rope)
    inv = [0] * rope
    for r, j in enumerate(perm):
        inv[j] = r  # new row j (transformers' row j) is old row inv[j]
    work = tempfile.mkdtemp()
    spec = {"metadata": json.load(open(args.metadata)), "tensors": []}
    moved = 0
    for i, (name, typ, shape) in enumerate(list_tensors(args.sparsemla, args.src)):
        f = os.path.join(work, f"t{i}.f32")
        subprocess.run([args.sparsemla, "inspect", args.src, "--tensor", name, "--dump", f], check=True,
                       stdout=subprocess.DEVNULL)
        data = open(f, "rb").read()
        row = shape[0] * 4
        starts = None  # first row of every rope block of this tensor
        if name.endswith(".attn_q_b.weight") and ".indexer." not in name:
            starts = range(nope, len(data) // row, nope + rope)
        elif name.endswith(".attn_kv_a_mqa.weight"):
            starts = [kvl]
        elif name.endswith(".indexer.attn_q_b.weight"):
            starts = range(0, len(data) // row, idim)
        elif name.endswith(".indexer.attn_k.weight"):
            starts = [0]
        if starts is not None:
            buf = bytearray(data)
            for s in starts:
                for j in range(rope):
                    buf[(s + j) * row:(s + j + 1) * row] = data[(s + inv[j]) * row:(s + inv[j] + 1) * row]
                moved += 1
            open(f, "wb").write(bytes(buf))
        spec["tensors"].append({"name": name, "shape": shape, "type": typ, "data": f})
    with open(os.path.join(work, "spec.json"), "w") as fh:
        json.dump(spec, fh)
    subprocess.run([args.sparsemla, "write-gguf", "--spec", os.path.join(work, "spec.json"), "-o", args.dst],
                   check=True, stdout=subprocess.DEVNULL)
    print(f"{args.dst}: {moved} rope blocks put back in transformers' row order")


if __name__ == "__main__":
    main()

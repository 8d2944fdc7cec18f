#!/usr/bin/env python3
"""Generate the quantization reference vectors in tests/data/quants/ with gguf-py.

For every block format that sparsemla dequantizes, this writes a few seeded random blocks and
the float32 values gguf-py's `gguf.quants.dequantize` makes of them; for the formats sparsemla
writes (F16, BF16, Q8_0) it writes float32 inputs and the bytes gguf-py's `gguf.quants.quantize`
makes of them. tests/unit/test_quants.cpp compares sparsemla against these files.

Usage:
    GGUF_PY=/path/to/gguf-py /usr/bin/python3 scripts/reference/make_quant_vectors.py \
        [--out tests/data/quants] [--seed 20240611]

GGUF_PY (or --gguf-py) is the directory that contains the `gguf` package from llama.cpp's
gguf-py/. numpy is required (on Debian, /usr/bin/python3 has it).

Files written (all little-endian, no headers):
    dequant_<type>.bin   raw blocks, a whole number of blocks of <type>
    dequant_<type>.f32   float32 values gguf-py dequantizes those blocks to
    quant_<type>.f32     float32 inputs (F16, BF16, Q8_0)
    quant_<type>.bin     bytes gguf-py quantizes those inputs to
    ggml_quant_sizes.txt gguf-py's GGML_QUANT_SIZES: "<id> <name> <block size> <type size>"
<type> is the ggml type name as sparsemla spells it (traits(t).name: "q4_K", "iq2_xxs", "bf16").

What the random data looks like, and why:
  * Block bytes are uniformly random, except the fp16 scale fields (d, dmin, m): random bytes
    there are often NaN, inf or 1e4-sized, which makes every output of the block NaN/inf or
    huge and the comparison meaningless. They are overwritten with random finite fp16 values
    with |x| log-uniform in [1e-3, 1] and a random sign. IQ1_M, whose fp16 scale is spread over
    the top nibbles of its four 16-bit scale words, gets the same treatment nibble by nibble.
  * MXFP4's E8M0 scale byte has no NaN in ggml's decoding; the first blocks use the extreme
    exponents 0, 1, 2, 254, 255 (subnormal and overflowing results) and the rest are random in
    [100, 150].
  * F32, F16 and BF16 "blocks" are random bit patterns, NaN, inf and subnormals included: their
    dequantization is exact, so every pattern has a defined answer.
  * Quantization inputs: Q8_0 uses random blocks over many magnitudes plus hand-made blocks (all
    zeros, signed zeros, exact .5 ties, values whose scale overflows or underflows fp16); no
    NaN/inf, whose Q8_0 result ggml leaves undefined. F16 uses random values over the whole
    fp16 range (overflow and subnormals included), exact rounding ties, infinities and the
    canonical quiet NaN only: for NaNs with a payload numpy keeps payload bits where ggml's
    converter (and sparsemla's) returns the canonical NaN. BF16 uses arbitrary bit patterns,
    NaN payloads included, since gguf-py's BF16 rounding is ggml's bit for bit.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]

N_BLOCKS = 16          # blocks per block format
N_PLAIN = 1024         # elements for the plain types F32, F16, BF16

# Byte offsets of the fp16 scale fields in each block (ggml-common.h layouts).
FP16_FIELDS: dict[str, tuple[int, ...]] = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,),
    "IQ1_S": (0,), "IQ4_NL": (0,), "IQ4_XS": (0,), "TQ1_0": (52,), "TQ2_0": (64,),
    "IQ1_M": (), "MXFP4": (),  # special scales, handled in random_blocks
}
PLAIN_TYPES = ("F32", "F16", "BF16")
DEQUANT_TYPES = PLAIN_TYPES + tuple(FP16_FIELDS)
QUANT_TYPES = ("F16", "BF16", "Q8_0")

# Sizes in which gguf-py is known to be wrong about ggml, as (gguf-py's, ggml's). gguf-py still
# has the old Q8_1 layout with float32 d and s (4 + 4 + 32 bytes); ggml's block_q8_1 has two fp16
# (ggml-common.h: static_assert(sizeof(block_q8_1) == 2*sizeof(ggml_half) + QK8_1)), 36 bytes.
# Q8_1 is an activation format that never appears in model files. Only this exact pair is accepted.
GGUF_PY_SIZE_ERRATA: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "Q8_1": ((32, 40), (32, 36)),
}


def import_gguf(path: str | None):
    path = path or os.environ.get("GGUF_PY")
    if not path:
        sys.exit("error: set GGUF_PY (or pass --gguf-py) to the directory that contains the gguf package")
    sys.path.insert(0, path)
    import gguf  # noqa: PLC0415 (the location is only known at run time)
    from gguf import quants  # noqa: PLC0415
    return gguf, quants


def sparsemla_type_table() -> dict[str, tuple[int, str, int, int]]:
    """ggml type table of src/gguf/ggml_types.{h,cpp}: upper-case name -> (id, name, block, size)."""
    header = (REPO / "src/gguf/ggml_types.h").read_text()
    source = (REPO / "src/gguf/ggml_types.cpp").read_text()
    enum = re.search(r"enum class GgmlType : uint32_t \{(.*?)\};", header, re.S)
    if not enum:
        sys.exit("error: cannot find enum GgmlType in src/gguf/ggml_types.h")
    ids = {name: int(value) for name, value in re.findall(r"(\w+)\s*=\s*(\d+)", enum.group(1))}
    rows = re.findall(r'\{GgmlType::(\w+), "(\w+)", (\d+), (\d+), (?:true|false)\}', source)
    if not rows:
        sys.exit("error: cannot find the type table in src/gguf/ggml_types.cpp")
    return {enum_name: (ids[enum_name], name, int(block), int(size)) for enum_name, name, block, size in rows}


def check_type_sizes(gguf) -> dict[str, tuple[int, str, int, int]]:
    """Fails loudly unless every sparsemla type has gguf-py's id, block size and type size."""
    ours = sparsemla_type_table()
    errors = []
    for enum_name, (type_id, name, block, size) in ours.items():
        if enum_name not in gguf.GGMLQuantizationType.__members__:
            errors.append(f"{enum_name}: not a gguf-py GGMLQuantizationType")
            continue
        qtype = gguf.GGMLQuantizationType[enum_name]
        if int(qtype) != type_id:
            errors.append(f"{enum_name}: id {type_id} in sparsemla, {int(qtype)} in gguf-py")
        if name.upper() != enum_name:
            errors.append(f"{enum_name}: sparsemla name {name!r} does not match")
        theirs = tuple(gguf.GGML_QUANT_SIZES[qtype])
        if GGUF_PY_SIZE_ERRATA.get(enum_name) == (theirs, (block, size)):
            print(f"note: {enum_name}: gguf-py says {theirs}, ggml (and sparsemla) {(block, size)}; "
                  "known gguf-py error")
            continue
        if (block, size) != theirs:
            errors.append(f"{enum_name}: (block, bytes) = {(block, size)} in sparsemla, {theirs} in gguf-py")
    if errors:
        sys.exit("error: src/gguf/ggml_types.cpp disagrees with gguf-py's GGML_QUANT_SIZES:\n  "
                 + "\n  ".join(errors))
    extra = sorted(t.name for t in gguf.GGMLQuantizationType if t.name not in ours)
    if extra:
        print(f"note: gguf-py types sparsemla does not know: {', '.join(extra)}")
    return ours


def random_fp16_scales(rng: np.random.Generator, n: int) -> np.ndarray:
    """n random finite fp16 bit patterns with |x| log-uniform in [1e-3, 1], random sign."""
    magnitude = 10.0 ** rng.uniform(-3.0, 0.0, size=n)
    sign = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    return (sign * magnitude).astype(np.float16).view(np.uint16)


def random_blocks(rng: np.random.Generator, name: str, n_blocks: int, type_size: int) -> np.ndarray:
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for offset in FP16_FIELDS[name]:
        blocks[:, offset:offset + 2] = random_fp16_scales(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
    if name == "IQ1_M":
        # The fp16 scale is the top nibbles of the four uint16 words at bytes 48..55,
        # least significant nibble in the first word.
        words = blocks[:, 48:56].copy().view("<u2")
        d = random_fp16_scales(rng, n_blocks).astype(np.uint16).reshape(n_blocks, 1)
        shifts = np.array([0, 4, 8, 12], dtype=np.uint16)
        words = (words & np.uint16(0x0FFF)) | (((d >> shifts) & np.uint16(0xF)) << np.uint16(12))
        blocks[:, 48:56] = words.astype("<u2").view(np.uint8)
    if name == "MXFP4":
        exponents = rng.integers(100, 151, size=n_blocks).astype(np.uint8)
        extremes = np.array([0, 1, 2, 254, 255], dtype=np.uint8)
        exponents[:len(extremes)] = extremes
        blocks[:, 0] = exponents
    return blocks


def plain_bits(rng: np.random.Generator, name: str, n: int) -> np.ndarray:
    width = 4 if name == "F32" else 2
    return rng.integers(0, 256, size=n * width, dtype=np.uint8)


def q8_0_inputs(rng: np.random.Generator) -> np.ndarray:
    random_part = rng.standard_normal((N_BLOCKS, 32)) * (10.0 ** rng.uniform(-4, 3, size=(N_BLOCKS, 1)))
    zeros = np.zeros(32)
    signed_zeros = np.where(np.arange(32) % 2 == 0, 0.0, -0.0)
    # amax 127 gives d = 1 and id = 1, so x * id is exactly the .5 tie: ggml rounds away from zero.
    ties = np.concatenate([[127.0], np.arange(-15, 16) + 0.5])
    huge = rng.uniform(-1e7, 1e7, size=32)    # d = amax/127 is beyond fp16's 65504: stored as inf
    tiny = rng.uniform(-1e-6, 1e-6, size=32)  # d rounds to an fp16 subnormal or zero
    single = np.zeros(32)
    single[7] = -3.25
    special = np.stack([zeros, signed_zeros, ties, huge, tiny, single])
    return np.concatenate([random_part, special]).astype(np.float32).reshape(-1)


def f16_inputs(rng: np.random.Generator) -> np.ndarray:
    n = N_PLAIN
    # Exponents from 2^-30 (below the smallest fp16 subnormal) to 2^17 (above fp16's max).
    exponent = rng.integers(127 - 30, 127 + 18, size=n, dtype=np.uint32)
    mantissa = rng.integers(0, 1 << 23, size=n, dtype=np.uint32)
    sign = rng.integers(0, 2, size=n, dtype=np.uint32)
    values = (sign << 31) | (exponent << 23) | mantissa
    # Exact ties between two fp16 normals: the 13 bits fp16 drops are 1000000000000.
    tie_exponent = rng.integers(127 - 14, 127 + 16, size=64, dtype=np.uint32)
    ties = (tie_exponent << 23) | (rng.integers(0, 1 << 10, size=64, dtype=np.uint32) << 13) | 0x1000
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 65504.0, 65519.996, 65520.0, -65520.0,
                        2.0 ** -24, 2.0 ** -25, 2.0 ** -25 * 1.0000001, 2.0 ** -14, 2.0 ** -14 * 0.99999],
                       dtype=np.float32).view(np.uint32)
    special[4:6] = [0x7FC00000, 0xFFC00000]  # canonical quiet NaNs, whatever numpy makes of -nan
    return np.concatenate([values, ties, special]).astype(np.uint32).view(np.float32)


def bf16_inputs(rng: np.random.Generator) -> np.ndarray:
    bits = rng.integers(0, 1 << 32, size=N_PLAIN, dtype=np.uint64).astype(np.uint32)
    ties = (rng.integers(0, 1 << 16, size=64, dtype=np.uint32) << 16) | 0x8000
    special = np.array([0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001,
                        0xFFFF8000, 0x7F7FFFFF, 0x7F7F8000, 0x00008000, 0x00018000], dtype=np.uint32)
    return np.concatenate([bits, ties, special]).view(np.float32)


def write(path: Path, data: np.ndarray) -> int:
    raw = np.ascontiguousarray(data).tobytes()
    path.write_bytes(raw)
    return len(raw)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf-py", help="directory containing the gguf package (default: $GGUF_PY)")
    ap.add_argument("--out", default=str(REPO / "tests/data/quants"))
    ap.add_argument("--seed", type=int, default=20240611)
    args = ap.parse_args()

    if sys.byteorder != "little":
        sys.exit("error: the vectors are little-endian; run this on a little-endian machine")
    gguf, quants = import_gguf(args.gguf_py)
    ours = check_type_sizes(gguf)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    total = 0

    lines = ["# gguf-py GGML_QUANT_SIZES: id name block_size type_size"]
    for qtype, (block, size) in sorted(gguf.GGML_QUANT_SIZES.items(), key=lambda kv: int(kv[0])):
        lines.append(f"{int(qtype)} {qtype.name} {block} {size}")
    total += write(out / "ggml_quant_sizes.txt", np.frombuffer(("\n".join(lines) + "\n").encode(), np.uint8))

    for name in DEQUANT_TYPES:
        qtype = gguf.GGMLQuantizationType[name]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        # One generator per type, keyed by the type id, so that adding a type changes no other file.
        rng = np.random.default_rng([args.seed, int(qtype)])
        if name in PLAIN_TYPES:
            raw = plain_bits(rng, name, N_PLAIN)
        else:
            raw = random_blocks(rng, name, N_BLOCKS, size).reshape(-1)
        with np.errstate(over="ignore"):  # MXFP4's largest exponents overflow float32 on purpose
            values = quants.dequantize(raw, qtype)
        if values.dtype != np.float32 or values.size != raw.size // size * block:
            sys.exit(f"error: gguf-py dequantize({name}) returned {values.dtype} x {values.size}")
        stem = ours[name][1]
        total += write(out / f"dequant_{stem}.bin", raw)
        total += write(out / f"dequant_{stem}.f32", values.astype("<f4"))

    makers = {"F16": f16_inputs, "BF16": bf16_inputs, "Q8_0": q8_0_inputs}
    for name in QUANT_TYPES:
        qtype = gguf.GGMLQuantizationType[name]
        rng = np.random.default_rng([args.seed, 1000 + int(qtype)])
        inputs = makers[name](rng)
        with np.errstate(over="ignore"):  # inputs beyond fp16's range overflow to inf on purpose
            encoded = np.ascontiguousarray(quants.quantize(inputs, qtype)).view(np.uint8)
        stem = ours[name][1]
        total += write(out / f"quant_{stem}.f32", inputs.astype("<f4"))
        total += write(out / f"quant_{stem}.bin", encoded)

    print(f"wrote {len(DEQUANT_TYPES)} dequantization and {len(QUANT_TYPES)} quantization vectors "
          f"({total} bytes) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Generate src/gguf/quant_tables.cpp from the codebooks defined in gguf-py.

gguf-py (llama.cpp's Python package, directory gguf-py/) stores the IQ lattices as packed hex
strings in gguf/quants.py; this script decodes them with gguf-py's own `init_grid` and writes
them out as C++ arrays, so the C++ tables come from ggml's reference Python code rather than
from a hand copy.

Usage:
    GGUF_PY=/path/to/gguf-py /usr/bin/python3 scripts/reference/gen_quant_tables.py \
        [--out src/gguf/quant_tables.cpp] [--source "llama.cpp gguf-py @ <commit>"] [--check] \
        [--ggml-common /path/to/ggml/src/ggml-common.h]

GGUF_PY (or --gguf-py) is the directory that contains the `gguf` package. --source is a
free-form description of where that gguf-py came from; it is written into the file header.
--check compares instead of writing and exits with status 1 when the file is out of date.
--ggml-common additionally cross-checks every table against the C tables of a ggml checkout
(read only, nothing of it is written out) and fails if any value differs.
numpy is required (on Debian, /usr/bin/python3 has it).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def import_gguf(path: str | None):
    path = path or os.environ.get("GGUF_PY")
    if not path:
        sys.exit("error: set GGUF_PY (or pass --gguf-py) to the directory that contains the gguf package")
    sys.path.insert(0, path)
    import gguf  # noqa: PLC0415 (the location is only known at run time)
    from gguf import quants  # noqa: PLC0415
    return gguf, quants


def decoded_grid(cls, dtype: str):
    """The grid of a gguf-py quant class as a list of rows of ints."""
    import numpy as np  # noqa: PLC0415

    cls.init_grid()
    grid = cls.grid.reshape(cls.grid_shape)
    as_int = grid.astype(np.int64)
    if not np.array_equal(as_int.astype(np.float32), grid):
        sys.exit(f"error: {cls.__name__} grid has non-integer values")
    lo, hi = (0, 255) if dtype == "uint8_t" else (-128, 127)
    if as_int.min() < lo or as_int.max() > hi:
        sys.exit(f"error: {cls.__name__} grid does not fit {dtype}")
    return as_int.tolist()


def format_rows(rows: list[list[int]]) -> str:
    width = max(len(str(v)) for row in rows for v in row)
    return "\n".join("  {" + ", ".join(str(v).rjust(width) for v in row) + "}," for row in rows)


def format_flat(values: list[int], per_line: int, hexa: bool = False) -> str:
    items = [f"0x{v:02x}" if hexa else str(v) for v in values]
    lines = [", ".join(items[i:i + per_line]) + "," for i in range(0, len(items), per_line)]
    return "\n".join("  " + line for line in lines)


def cross_check_ggml(quants, header: Path) -> None:
    """Compares gguf-py's tables with the GGML_TABLE_BEGIN tables of ggml-common.h."""
    import re  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415

    text = header.read_text()

    def table(name: str) -> np.ndarray:
        m = re.search(r"GGML_TABLE_BEGIN\((\w+), " + name + r", \w+\)(.*?)GGML_TABLE_END", text, re.S)
        if not m:
            sys.exit(f"error: no table {name} in {header}")
        ctype, body = m.group(1), m.group(2)
        values = [int(v, 0) for v in re.findall(r"-?0x[0-9a-fA-F]+|-?\d+", body)]
        dtype = {"uint64_t": "<u8", "uint32_t": "<u4", "uint8_t": "u1", "int8_t": "i1"}[ctype]
        return np.array(values, dtype=dtype).view(np.uint8 if ctype != "int8_t" else np.int8)

    # ggml packs a grid row into one integer, first element in the lowest byte.
    pairs = [(quants.IQ2_XXS, "iq2xxs_grid"), (quants.IQ2_XS, "iq2xs_grid"), (quants.IQ2_S, "iq2s_grid"),
             (quants.IQ3_XXS, "iq3xxs_grid"), (quants.IQ3_S, "iq3s_grid"), (quants.IQ1_S, "iq1s_grid")]
    failed = []
    for cls, name in pairs:
        ours = np.array(decoded_grid(cls, "int8_t" if name == "iq1s_grid" else "uint8_t")).reshape(-1)
        theirs = table(name)
        if name == "iq1s_grid":
            theirs = theirs.view(np.int8)
        if not np.array_equal(ours, theirs.astype(np.int64)):
            failed.append(name)
    if not np.array_equal(np.frombuffer(quants.IQ2_XXS.ksigns, np.uint8), table("ksigns_iq2xs")):
        failed.append("ksigns_iq2xs")
    if list(quants.IQ4_NL.kvalues) != table("kvalues_iq4nl").tolist():
        failed.append("kvalues_iq4nl")
    if list(quants.MXFP4.kvalues) != table("kvalues_fp4").tolist():
        failed.append("kvalues_fp4")
    if failed:
        sys.exit(f"error: gguf-py and {header} disagree on: {', '.join(failed)}")
    print(f"gguf-py tables agree with {header}")


def generate(quants, source: str) -> str:
    import numpy as np  # noqa: PLC0415

    # (C++ name, gguf-py class, element type, expected shape); the shapes are those declared in
    # quant_tables.h, so a gguf-py change of geometry stops here instead of compiling silently.
    grids = [
        ("kIq2xxsGrid", quants.IQ2_XXS, "uint8_t", (256, 8)),
        ("kIq2xsGrid", quants.IQ2_XS, "uint8_t", (512, 8)),
        ("kIq2sGrid", quants.IQ2_S, "uint8_t", (1024, 8)),
        ("kIq3xxsGrid", quants.IQ3_XXS, "uint8_t", (256, 4)),
        ("kIq3sGrid", quants.IQ3_S, "uint8_t", (512, 4)),
        ("kIq1sGrid", quants.IQ1_S, "int8_t", (2048, 8)),
    ]
    if quants.IQ1_M.grid_hex != quants.IQ1_S.grid_hex:
        sys.exit("error: gguf-py's IQ1_M no longer shares IQ1_S's grid; quant_tables.h assumes it does")
    if float(quants.IQ1_M.delta) != float(quants.IQ1_S.delta):
        sys.exit("error: gguf-py's IQ1_M and IQ1_S deltas differ; quant_tables.h has one delta")

    signs = list(np.frombuffer(quants.IQ2_XXS.ksigns, dtype=np.uint8))
    iq4nl = list(quants.IQ4_NL.kvalues)
    mxfp4 = list(quants.MXFP4.kvalues)
    if len(signs) != 128 or len(iq4nl) != 16 or len(mxfp4) != 16:
        sys.exit("error: unexpected size of ksigns / IQ4_NL kvalues / MXFP4 kvalues in gguf-py")

    out = [
        "// GENERATED FILE: do not edit. Regenerate with scripts/reference/gen_quant_tables.py.",
        f"// Source: {source}.",
        "// Every table below is decoded from gguf-py/gguf/quants.py: the packed `grid_hex` strings of",
        "// IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S and IQ1_S (decoded by gguf-py's own init_grid), the",
        "// IQ2_XXS `ksigns` bytes, IQ1_S `delta`, IQ4_NL `kvalues` and MXFP4 `kvalues`.",
        '#include "gguf/quant_tables.h"',
        "",
        "namespace sparsemla::gguf::tables {",
        "",
    ]
    for name, cls, dtype, shape in grids:
        if tuple(cls.grid_shape) != shape:
            sys.exit(f"error: gguf-py {cls.__name__}.grid_shape is {cls.grid_shape}, "
                     f"quant_tables.h expects {shape}")
        rows = decoded_grid(cls, dtype)
        out += [f"const {dtype} {name}[{shape[0]}][{shape[1]}] = {{", format_rows(rows), "};", ""]
    out += [f"const float kIq1Delta = {float(quants.IQ1_S.delta)!r}f;", ""]
    out += ["const uint8_t kIq2Signs[128] = {", format_flat([int(v) for v in signs], 16, hexa=True), "};", ""]
    out += ["const int8_t kIq4nlValues[16] = {", format_flat(iq4nl, 16), "};", ""]
    out += ["const int8_t kMxfp4Values[16] = {", format_flat(mxfp4, 16), "};", ""]
    out += ["}  // namespace sparsemla::gguf::tables", ""]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf-py", help="directory containing the gguf package (default: $GGUF_PY)")
    ap.add_argument("--out", default=str(REPO / "src/gguf/quant_tables.cpp"))
    ap.add_argument("--source", default=os.environ.get("GGUF_PY_SOURCE", "gguf-py (revision not recorded)"),
                    help="where the gguf-py copy came from, for the file header (default: $GGUF_PY_SOURCE)")
    ap.add_argument("--check", action="store_true", help="fail if --out differs from the generated text")
    ap.add_argument("--ggml-common", type=Path,
                    help="ggml-common.h of a ggml checkout to cross-check against")
    args = ap.parse_args()

    _, quants = import_gguf(args.gguf_py)
    if args.ggml_common:
        cross_check_ggml(quants, args.ggml_common)
    text = generate(quants, args.source)
    out = Path(args.out)
    if args.check:
        if not out.exists() or out.read_text() != text:
            print(f"{out} is out of date; rerun {Path(__file__).name}", file=sys.stderr)
            return 1
        print(f"{out} is up to date")
        return 0
    out.write_text(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

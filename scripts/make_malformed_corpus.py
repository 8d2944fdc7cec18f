#!/usr/bin/env python3
"""Writes tests/malformed/: hand-made GGUF files, each broken in one way, with the text its error
message must contain. Built byte by byte with struct (no GGUF library), so the corpus does not
depend on the reader it tests. The same files seed the libFuzzer corpus.

Usage: python3 scripts/make_malformed_corpus.py [OUT_DIR]   (default tests/malformed)
"""
import os
import shutil
import struct
import sys

U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
F32_T, F16_T, Q4_K_T, Q8_0_T = 0, 1, 12, 8


def s(text):
    b = text.encode()
    return struct.pack("<Q", len(b)) + b


def kv(key, vtype, payload):
    return s(key) + struct.pack("<I", vtype) + payload


def kv_u32(key, v):
    return kv(key, U32, struct.pack("<I", v))


def kv_str(key, v):
    return kv(key, STR, s(v))


def tinfo(name, dims, ggml_type, offset):
    return s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<q", d) for d in dims) + \
        struct.pack("<IQ", ggml_type, offset)


def gguf(kvs, tinfos, data=b"", version=3, magic=b"GGUF", align=32, n_tensors=None, n_kv=None):
    head = magic + struct.pack("<IQQ", version, len(tinfos) if n_tensors is None else n_tensors,
                               len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(tinfos)
    body += b"\0" * ((-len(body)) % align)
    return body + data


ARCH = kv_str("general.architecture", "glm-dsa")
ONE = [tinfo("t", [8], F32_T, 0)]
ONE_DATA = struct.pack("<8f", *range(8))


def cases():
    """(file name, bytes or {part name: bytes}, text the error must contain)"""
    yield "bad_magic.gguf", gguf([ARCH], ONE, ONE_DATA, magic=b"GGML"), "bad magic"
    yield "empty.gguf", b"", "truncated"
    yield "version_1.gguf", gguf([ARCH], ONE, ONE_DATA, version=1), "unsupported GGUF version 1"
    yield "version_99.gguf", gguf([ARCH], ONE, ONE_DATA, version=99), "unsupported GGUF version 99"
    yield "big_endian.gguf", b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "big-endian"
    yield "truncated_header.gguf", gguf([ARCH], ONE, ONE_DATA)[:30], "truncated"
    yield "truncated_in_tensor_info.gguf", gguf([ARCH], ONE, align=1)[:-5], "truncated: reading tensor 't'"
    yield "string_past_end.gguf", gguf([s("general.architecture") + struct.pack("<IQ", STR, 1 << 40)], []), \
        "runs past the end of the file"
    yield "key_length_past_end.gguf", gguf([struct.pack("<Q", 1 << 62)], [], b"\0" * 64), \
        "metadata key #0: string length 4611686018427387904"
    yield "array_past_end.gguf", gguf([kv("a", ARR, struct.pack("<IQ", U64, 1 << 50))], []), \
        "array of 1125899906842624 uint64 elements"
    yield "nested_array_past_end.gguf", gguf([kv("a", ARR, struct.pack("<IQ", ARR, 2) +
                                                 struct.pack("<IQ", U8, 1) + b"x" +
                                                 struct.pack("<IQ", STR, 1 << 33))], []), \
        "array of 8589934592 string elements"
    yield "deep_nesting.gguf", gguf([kv("a", ARR, struct.pack("<IQ", ARR, 1) * 40)], []), "nested deeper"
    yield "unknown_value_type.gguf", gguf([kv("general.x", 13, b"")], []), "unknown value type 13"
    yield "unknown_array_type.gguf", gguf([kv("general.x", ARR, struct.pack("<IQ", 77, 1))], []), \
        "unknown array element type 77"
    yield "bad_bool.gguf", gguf([kv("general.flag", BOOL, b"\x07")], []), "bool value must be 0 or 1"
    yield "duplicate_key.gguf", gguf([ARCH, ARCH], []), "duplicate metadata key 'general.architecture'"
    yield "huge_kv_count.gguf", gguf([ARCH], [], n_kv=1 << 60), "metadata count"
    yield "huge_tensor_count.gguf", gguf([ARCH], [], n_tensors=1 << 60), "tensor count"
    yield "alignment_not_pow2.gguf", gguf([ARCH, kv_u32("general.alignment", 48)], []), \
        "expected a power of two, found 48"
    yield "alignment_zero.gguf", gguf([ARCH, kv_u32("general.alignment", 0)], []), "expected a power of two, found 0"
    yield "alignment_wrong_type.gguf", gguf([ARCH, kv_str("general.alignment", "32")], []), \
        "key 'general.alignment': expected uint32, found string"
    yield "n_dims_5.gguf", gguf([ARCH], [tinfo("t", [1, 1, 1, 1, 8], F32_T, 0)], ONE_DATA), \
        "n_dims is 5, expected 1 to 4"
    yield "n_dims_0.gguf", gguf([ARCH], [tinfo("t", [], F32_T, 0)], ONE_DATA), "n_dims is 0"
    yield "zero_dim.gguf", gguf([ARCH], [tinfo("t", [8, 0], F32_T, 0)], ONE_DATA), "dimension 1 is 0"
    yield "negative_dim.gguf", gguf([ARCH], [tinfo("t", [8, -3], F32_T, 0)], ONE_DATA), "dimension 1 is -3"
    yield "overflow_dims.gguf", gguf([ARCH], [tinfo("t", [1 << 40, 1 << 40], F32_T, 0)], ONE_DATA), \
        "element count overflows"
    yield "overflow_bytes.gguf", gguf([ARCH], [tinfo("t", [1 << 31, 1 << 31], F32_T, 0)], ONE_DATA), \
        "byte size overflows"
    yield "unknown_ggml_type.gguf", gguf([ARCH], [tinfo("t", [8], 4, 0)], ONE_DATA), "unknown ggml type 4"
    yield "unknown_ggml_type_big.gguf", gguf([ARCH], [tinfo("t", [8], 1000, 0)], ONE_DATA), "unknown ggml type 1000"
    yield "row_not_block_multiple.gguf", gguf([ARCH], [tinfo("t", [100], Q4_K_T, 0)], b"\0" * 160), \
        "not a multiple of the q4_K block size 256"
    yield "data_outside_file.gguf", gguf([ARCH], [tinfo("t", [8], F32_T, 64)], ONE_DATA), "lies outside the file"
    yield "data_truncated.gguf", gguf([ARCH], [tinfo("t", [64], F32_T, 0)], ONE_DATA), "lies outside the file"
    yield "misaligned_offset.gguf", gguf([ARCH], [tinfo("a", [8], F32_T, 0), tinfo("b", [4], F32_T, 36)],
                                         ONE_DATA * 3), "is not a multiple of the alignment 32"
    yield "overlapping_tensors.gguf", gguf([ARCH], [tinfo("a", [16], F32_T, 0), tinfo("b", [8], F32_T, 32)],
                                           ONE_DATA * 3), "overlaps tensor"
    yield "duplicate_tensor.gguf", gguf([ARCH], [tinfo("a", [8], F32_T, 0), tinfo("a", [8], F32_T, 32)],
                                        ONE_DATA * 2), "duplicate tensor name 'a'"
    yield "split_count_without_split_name.gguf", gguf([ARCH, kv("split.count", U16, struct.pack("<H", 3))], ONE,
                                                      ONE_DATA), "does not follow NAME-0000k-of-00003.gguf"

    def part(no, count, total, tensors, with_arch):
        kvs = ([ARCH] if with_arch else []) + [kv("split.no", U16, struct.pack("<H", no)),
                                               kv("split.count", U16, struct.pack("<H", count)),
                                               kv("split.tensors.count", I32, struct.pack("<i", total))]
        return gguf(kvs, [tinfo(n, [8], F32_T, 32 * i) for i, n in enumerate(tensors)], ONE_DATA * len(tensors))

    good = {f"m-0000{i + 1}-of-00003.gguf": part(i, 3, 3, [f"t{i}"], i == 0) for i in range(3)}
    missing = dict(good)
    del missing["m-00002-of-00003.gguf"]
    yield "split_missing_part", missing, "split file 2 of 3 is missing"
    extra = dict(good)
    extra["m-00004-of-00004.gguf"] = part(3, 4, 4, ["t3"], False)
    yield "split_extra_part", extra, "extra split file"
    wrong_no = dict(good)
    wrong_no["m-00002-of-00003.gguf"] = part(2, 3, 3, ["t1"], False)
    yield "split_wrong_no", wrong_no, "key 'split.no': expected 1 (file 2 of 3), found 2"
    wrong_count = dict(good)
    wrong_count["m-00003-of-00003.gguf"] = part(2, 4, 3, ["t2"], False)
    yield "split_wrong_count", wrong_count, "key 'split.count': expected 3 (from the file name), found 4"
    wrong_total = {f"m-0000{i + 1}-of-00003.gguf": part(i, 3, 5, [f"t{i}"], i == 0) for i in range(3)}
    yield "split_wrong_tensor_count", wrong_total, "key 'split.tensors.count' says 5 tensors, but the 3 file(s) hold 3"
    dup = dict(good)
    dup["m-00003-of-00003.gguf"] = part(2, 3, 3, ["t0"], False)
    yield "split_duplicate_tensor", dup, "duplicate tensor name 't0'"
    no_keys = dict(good)
    no_keys["m-00002-of-00003.gguf"] = gguf([], [tinfo("t1", [8], F32_T, 0)], ONE_DATA)
    yield "split_part_without_keys", no_keys, "has no 'split.count' key"


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "tests", "malformed")
    for name in os.listdir(out) if os.path.isdir(out) else []:
        p = os.path.join(out, name)
        if name.endswith(".gguf") or name.endswith(".expect"):
            os.remove(p)
        elif os.path.isdir(p):
            shutil.rmtree(p)
    os.makedirs(out, exist_ok=True)
    for name, content, expect in cases():
        if isinstance(content, dict):
            d = os.path.join(out, name)
            os.makedirs(d)
            for part_name, data in content.items():
                with open(os.path.join(d, part_name), "wb") as f:
                    f.write(data)
            # the file the check opens: the first part when present, else the last
            first = sorted(content)[0]
            with open(os.path.join(out, name + ".expect"), "w") as f:
                f.write(f"{name}/{first}\n{expect}\n")
        else:
            with open(os.path.join(out, name), "wb") as f:
                f.write(content)
            with open(os.path.join(out, name + ".expect"), "w") as f:
                f.write(f"{name}\n{expect}\n")


if __name__ == "__main__":
    main()

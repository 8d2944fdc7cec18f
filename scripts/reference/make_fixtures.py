#!/usr/bin/env python3
"""Reference fixtures for the engine, from Hugging Face transformers (>= 5.17) in float64.

Builds small random-weight GlmMoeDsaForCausalLM and DeepseekV32ForCausalLM models, writes each to
GGUF with the project's own writer (`sparsemla write-gguf`) in exactly llama.cpp's tensor names and
layouts (MODEL_SPEC.md), and records transformers' float64 logits for prompts longer than the
indexer's top-k, the same logits with top-k >= the prompt (the dense reference), and a greedy
continuation. Quantized variants are written quantized, read back dequantized (`sparsemla inspect
--dump`), and the reference is computed from those dequantized weights, so the reference and the
engine see the same numbers. Ties at the top-k boundary make a reference ambiguous: the smallest
relative gap between the k-th and (k+1)-th indexer score is measured and the weights are redrawn
when it is below 1e-4.

Run on a machine with torch and transformers (the GPU machine has both; the GPU is not needed):
    python3 scripts/reference/make_fixtures.py --sparsemla build/sparsemla --out tests/fixtures
Each variant becomes a folder: model.gguf, seq0/seq1.tokens (int32), seq*.logits.f32 (sparse,
[n, vocab] float32), seq*.dense.logits.f32, greedy.json, topk_margin.json, config.json.
"""
import argparse
import json
import os
import subprocess
import tempfile
import zlib

import numpy as np
import torch

torch.set_grad_enabled(False)

VARIANTS = {
    # GLM-5 structure: nope != v, IndexShare ("shared" layers reuse the previous full top-k), a
    # dense first layer, MoE with a shared expert, one MTP layer.
    "glm_share": dict(arch="glm-dsa", quant=None, tokenizer="glm_pub",
                      dims=dict(hidden=128, q_lora=64, kv_lora=32, nope=16, rope=16, v=32, heads=4, ff=256,
                                ff_exp=64, experts=8, used=2, shared=1, groups=1, groups_used=1, idx_heads=8,
                                idx_dim=64, topk=12, layers=4, dense=1, nextn=1,
                                indexer_types=["full", "shared", "full", "shared"])),
    # The same model stored as Q8_0.
    "glm_share_q8_0": dict(arch="glm-dsa", quant="q8_0", same_as="glm_share", tokenizer="glm_pub"),
    # K-quants: every matrix whose rows are a multiple of 256 is Q4_K, the rest Q8_0 (as in
    # llama.cpp's Q4_K_M mixes).
    "glm_q4_k": dict(arch="glm-dsa", quant="q4_K", tokenizer="glm_pub",
                     dims=dict(hidden=256, q_lora=256, kv_lora=256, nope=32, rope=32, v=32, heads=4, ff=512,
                               ff_exp=256, experts=8, used=2, shared=1, groups=1, groups_used=1, idx_heads=16,
                               idx_dim=64, topk=12, layers=3, dense=1, nextn=0, indexer_types=None)),
    # DeepSeek-V3.2 structure: YaRN, group-limited routing, half-split indexer RoPE.
    "dsv32_groups": dict(arch="deepseek32", quant=None, tokenizer="dsv32_pub",
                         dims=dict(hidden=64, q_lora=32, kv_lora=32, nope=16, rope=8, v=16, heads=4, ff=192,
                                   ff_exp=48, experts=8, used=4, shared=1, groups=4, groups_used=2, idx_heads=8,
                                   idx_dim=64, topk=12, layers=3, dense=1, nextn=0, indexer_types=None)),
}
VOCAB = 1024
PROMPT_LENGTHS = (40, 64)
GREEDY_PROMPT, GREEDY_STEPS = 24, 12


def make_config(arch, d):
    common = dict(vocab_size=VOCAB, hidden_size=d["hidden"], intermediate_size=d["ff"],
                  moe_intermediate_size=d["ff_exp"], num_hidden_layers=d["layers"],
                  num_attention_heads=d["heads"], num_key_value_heads=d["heads"], n_shared_experts=d["shared"],
                  n_routed_experts=d["experts"], routed_scaling_factor=2.5, kv_lora_rank=d["kv_lora"],
                  q_lora_rank=d["q_lora"], qk_rope_head_dim=d["rope"], v_head_dim=d["v"],
                  qk_nope_head_dim=d["nope"], n_group=d["groups"], topk_group=d["groups_used"],
                  num_experts_per_tok=d["used"], norm_topk_prob=True, index_topk=d["topk"],
                  index_head_dim=d["idx_dim"], index_n_heads=d["idx_heads"], first_k_dense_replace=d["dense"],
                  tie_word_embeddings=False)
    if arch == "glm-dsa":
        from transformers import GlmMoeDsaConfig
        cfg = GlmMoeDsaConfig(max_position_embeddings=4096, rms_norm_eps=1e-5,
                              rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                              indexer_types=d["indexer_types"] or ["full"] * d["layers"], **common)
    else:
        from transformers import DeepseekV32Config
        cfg = DeepseekV32Config(max_position_embeddings=128, rms_norm_eps=1e-6,
                                rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                 "original_max_position_embeddings": 32, "beta_fast": 32,
                                                 "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
                                **common)
    # float64 needs the plain implementations: SDPA kernels and grouped_mm refuse doubles.
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    return cfg


def make_model(arch, cfg, seed):
    if arch == "glm-dsa":
        from transformers import GlmMoeDsaForCausalLM as M
    else:
        from transformers import DeepseekV32ForCausalLM as M
    torch.manual_seed(seed)
    model = M(cfg).double().eval()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    g = torch.Generator().manual_seed(seed)
    # Weights of unit-scale activations (the default init makes logits nearly uniform).
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        elif name.endswith(".bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
        else:
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) / p.shape[-1] ** 0.5)
    for name, b in model.named_buffers():
        if "e_score_correction_bias" in name:
            b.copy_(0.1 * torch.randn(b.shape, generator=g, dtype=b.dtype))
    return model


def to_gguf(sd, cfg, arch, d):
    """HF state dict -> {gguf name: float32 array whose last axis is ggml's ne0}, as llama.cpp's
    converter lays them out. No rope rows are permuted: transformers 5.17 runs GLM-MoE-DSA's main
    attention and indexer with interleaved RoPE, and DeepSeek-V3.2's main attention interleaved and
    its indexer half-split, exactly as the engine does on the GGUF (checked against the real
    converter's output in tests/fixtures/glm_pub and dsv32_pub)."""
    nh, nope, rope, v, kvl = d["heads"], d["nope"], d["rope"], d["v"], d["kv_lora"]
    t = {}
    a = lambda k: sd[k].detach().cpu().numpy().astype(np.float64)
    t["token_embd.weight"] = a("model.embed_tokens.weight")
    t["output_norm.weight"] = a("model.norm.weight")
    t["output.weight"] = a("lm_head.weight")
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        b = f"blk.{i}."
        t[b + "attn_norm.weight"] = a(p + "input_layernorm.weight")
        t[b + "ffn_norm.weight"] = a(p + "post_attention_layernorm.weight")
        t[b + "attn_q_a.weight"] = a(p + "self_attn.q_a_proj.weight")
        t[b + "attn_q_a_norm.weight"] = a(p + "self_attn.q_a_layernorm.weight")
        t[b + "attn_q_b.weight"] = a(p + "self_attn.q_b_proj.weight")
        t[b + "attn_kv_a_mqa.weight"] = a(p + "self_attn.kv_a_proj_with_mqa.weight")
        t[b + "attn_kv_a_norm.weight"] = a(p + "self_attn.kv_a_layernorm.weight")
        kvb = a(p + "self_attn.kv_b_proj.weight").reshape(nh, nope + v, kvl)
        t[b + "attn_k_b.weight"] = np.ascontiguousarray(kvb[:, :nope, :].transpose(0, 2, 1))  # {nope, kvl, nh}
        t[b + "attn_v_b.weight"] = np.ascontiguousarray(kvb[:, nope:, :])                      # {kvl, v, nh}
        t[b + "attn_output.weight"] = a(p + "self_attn.o_proj.weight")
        ix = p + "self_attn.indexer."
        shared = (d.get("indexer_types") or ["full"] * cfg.num_hidden_layers)[i] == "shared"
        if ix + "wk.weight" in sd and not shared:  # llama.cpp writes no indexer for "shared" layers
            t[b + "indexer.attn_q_b.weight"] = a(ix + "wq_b.weight")
            t[b + "indexer.attn_k.weight"] = a(ix + "wk.weight")
            t[b + "indexer.k_norm.weight"] = a(ix + "k_norm.weight")
            t[b + "indexer.k_norm.bias"] = a(ix + "k_norm.bias")
            t[b + "indexer.proj.weight"] = a(ix + "weights_proj.weight")
        if p + "mlp.gate.weight" in sd:
            F = d["ff_exp"]
            t[b + "ffn_gate_inp.weight"] = a(p + "mlp.gate.weight")
            t[b + "exp_probs_b.bias"] = a(p + "mlp.gate.e_score_correction_bias")
            if p + "mlp.experts.gate_up_proj" in sd:
                gu = a(p + "mlp.experts.gate_up_proj")  # [E, 2F, H]
                t[b + "ffn_gate_exps.weight"] = np.ascontiguousarray(gu[:, :F, :])
                t[b + "ffn_up_exps.weight"] = np.ascontiguousarray(gu[:, F:, :])
                t[b + "ffn_down_exps.weight"] = a(p + "mlp.experts.down_proj")  # [E, H, F]
            else:
                E = d["experts"]
                for proj, name in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
                    t[b + f"ffn_{name}_exps.weight"] = np.stack(
                        [a(p + f"mlp.experts.{e}.{proj}.weight") for e in range(E)])
            for proj in ("gate", "up", "down"):
                t[b + f"ffn_{proj}_shexp.weight"] = a(p + f"mlp.shared_experts.{proj}_proj.weight")
        else:
            for proj in ("gate", "up", "down"):
                t[b + f"ffn_{proj}.weight"] = a(p + f"mlp.{proj}_proj.weight")
    return t


def from_gguf(t, sd, cfg, arch, d):
    """The inverse of to_gguf: writes GGUF-layout arrays back into the HF state dict."""
    nh, nope, v, kvl = d["heads"], d["nope"], d["v"], d["kv_lora"]
    out = {}
    out["model.embed_tokens.weight"] = t["token_embd.weight"]
    out["model.norm.weight"] = t["output_norm.weight"]
    out["lm_head.weight"] = t["output.weight"]
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out[p + "input_layernorm.weight"] = t[b + "attn_norm.weight"]
        out[p + "post_attention_layernorm.weight"] = t[b + "ffn_norm.weight"]
        out[p + "self_attn.q_a_proj.weight"] = t[b + "attn_q_a.weight"]
        out[p + "self_attn.q_a_layernorm.weight"] = t[b + "attn_q_a_norm.weight"]
        out[p + "self_attn.q_b_proj.weight"] = t[b + "attn_q_b.weight"]
        out[p + "self_attn.kv_a_proj_with_mqa.weight"] = t[b + "attn_kv_a_mqa.weight"]
        out[p + "self_attn.kv_a_layernorm.weight"] = t[b + "attn_kv_a_norm.weight"]
        kb = t[b + "attn_k_b.weight"].transpose(0, 2, 1)
        out[p + "self_attn.kv_b_proj.weight"] = np.concatenate([kb, t[b + "attn_v_b.weight"]], axis=1).reshape(
            nh * (nope + v), kvl)
        out[p + "self_attn.o_proj.weight"] = t[b + "attn_output.weight"]
        ix = p + "self_attn.indexer."
        if b + "indexer.attn_k.weight" in t:
            out[ix + "wq_b.weight"] = t[b + "indexer.attn_q_b.weight"]
            out[ix + "wk.weight"] = t[b + "indexer.attn_k.weight"]
            out[ix + "k_norm.weight"] = t[b + "indexer.k_norm.weight"]
            out[ix + "k_norm.bias"] = t[b + "indexer.k_norm.bias"]
            out[ix + "weights_proj.weight"] = t[b + "indexer.proj.weight"]
        if b + "ffn_gate_inp.weight" in t:
            out[p + "mlp.gate.weight"] = t[b + "ffn_gate_inp.weight"]
            out[p + "mlp.gate.e_score_correction_bias"] = t[b + "exp_probs_b.bias"]
            if p + "mlp.experts.gate_up_proj" in sd:
                out[p + "mlp.experts.gate_up_proj"] = np.concatenate(
                    [t[b + "ffn_gate_exps.weight"], t[b + "ffn_up_exps.weight"]], axis=1)
                out[p + "mlp.experts.down_proj"] = t[b + "ffn_down_exps.weight"]
            else:
                for proj, name in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
                    for e in range(d["experts"]):
                        out[p + f"mlp.experts.{e}.{proj}.weight"] = t[b + f"ffn_{name}_exps.weight"][e]
            for proj in ("gate", "up", "down"):
                out[p + f"mlp.shared_experts.{proj}_proj.weight"] = t[b + f"ffn_{proj}_shexp.weight"]
        else:
            for proj in ("gate", "up", "down"):
                out[p + f"mlp.{proj}_proj.weight"] = t[b + f"ffn_{proj}.weight"]
    return out


def mtp_tensors(t, d, layer, rng):
    """A next-n (MTP) layer: a full MoE block plus the nextn tensors, random (transformers does not
    run it; the engine loads and validates it)."""
    H = d["hidden"]
    src = layer - 1
    out = {}
    for name, arr in t.items():
        if name.startswith(f"blk.{src}."):
            out[name.replace(f"blk.{src}.", f"blk.{layer}.")] = rng.standard_normal(arr.shape) / np.sqrt(arr.shape[-1])
    b = f"blk.{layer}.nextn."
    out[b + "eh_proj.weight"] = rng.standard_normal((H, 2 * H)) / np.sqrt(2 * H)
    out[b + "enorm.weight"] = 1 + 0.1 * rng.standard_normal(H)
    out[b + "hnorm.weight"] = 1 + 0.1 * rng.standard_normal(H)
    out[b + "shared_head_norm.weight"] = 1 + 0.1 * rng.standard_normal(H)
    out[b + "shared_head_head.weight"] = rng.standard_normal((VOCAB, H)) / np.sqrt(H)
    return out


def metadata(arch, cfg, d):
    k = lambda key, typ, val: {"key": f"{arch}.{key}", "type": typ, "value": val}
    m = [{"key": "general.architecture", "type": "string", "value": arch},
         {"key": "general.name", "type": "string", "value": "sparsemla reference fixture"},
         k("block_count", "u32", d["layers"] + d["nextn"]), k("context_length", "u32", cfg.max_position_embeddings),
         k("embedding_length", "u32", d["hidden"]), k("feed_forward_length", "u32", d["ff"]),
         k("attention.head_count", "u32", d["heads"]), k("attention.head_count_kv", "u32", 1),
         k("rope.freq_base", "f32", cfg.rope_parameters["rope_theta"]),
         k("attention.layer_norm_rms_epsilon", "f32", cfg.rms_norm_eps),
         k("expert_count", "u32", d["experts"]), k("expert_used_count", "u32", d["used"]),
         k("expert_group_count", "u32", d["groups"]), k("expert_group_used_count", "u32", d["groups_used"]),
         k("expert_gating_func", "u32", 2), k("attention.key_length", "u32", d["kv_lora"] + d["rope"]),
         k("attention.value_length", "u32", d["kv_lora"]), k("leading_dense_block_count", "u32", d["dense"]),
         k("vocab_size", "u32", VOCAB), k("attention.q_lora_rank", "u32", d["q_lora"]),
         k("attention.kv_lora_rank", "u32", d["kv_lora"]),
         k("attention.key_length_mla", "u32", d["nope"] + d["rope"]),
         k("attention.value_length_mla", "u32", d["v"]), k("expert_feed_forward_length", "u32", d["ff_exp"]),
         k("expert_shared_count", "u32", d["shared"]), k("expert_weights_scale", "f32", 2.5),
         k("expert_weights_norm", "bool", True), k("rope.dimension_count", "u32", d["rope"]),
         k("nextn_predict_layers", "u32", d["nextn"]), k("attention.indexer.head_count", "u32", d["idx_heads"]),
         k("attention.indexer.key_length", "u32", d["idx_dim"]), k("attention.indexer.top_k", "u32", d["topk"])]
    if d.get("indexer_types"):
        m.append({"key": f"{arch}.attention.indexer.types", "type": "array", "elem": "bool",
                  "value": [x == "full" for x in d["indexer_types"]]})
    rp = cfg.rope_parameters
    if rp.get("rope_type") == "yarn":
        m += [k("rope.scaling.type", "string", "yarn"), k("rope.scaling.factor", "f32", rp["factor"]),
              k("rope.scaling.original_context_length", "u32", rp["original_max_position_embeddings"]),
              k("rope.scaling.yarn_beta_fast", "f32", rp["beta_fast"]),
              k("rope.scaling.yarn_beta_slow", "f32", rp["beta_slow"]),
              k("rope.scaling.yarn_log_multiplier", "f32", 0.1 * rp["mscale_all_dim"])]
    return m


def tensor_type(name, shape, quant):
    """F32 for 1-D tensors, the router and the indexer weights (as llama.cpp keeps them)."""
    ne0 = shape[-1]
    if quant is None or len(shape) < 2 or "ffn_gate_inp" in name or "indexer.proj" in name:
        return "f32"
    if quant == "q4_K":
        return "q4_K" if ne0 % 256 == 0 else ("q8_0" if ne0 % 32 == 0 else "f32")
    return quant if ne0 % 32 == 0 else "f32"


def write_gguf(sm, tensors, meta, quant, tokenizer_gguf, path, work):
    spec = {"metadata": meta, "tensors": []}
    if tokenizer_gguf:  # None: the tokenizer keys are in `meta`
        spec["copy_metadata_from"] = {"file": tokenizer_gguf, "prefix": "tokenizer."}
    for i, (name, arr) in enumerate(tensors.items()):
        f = f"t{i}.f32"
        np.ascontiguousarray(arr, dtype=np.float32).tofile(os.path.join(work, f))
        spec["tensors"].append({"name": name, "shape": list(reversed(arr.shape)), "data": f,
                                "type": tensor_type(name, arr.shape, quant)})
    with open(os.path.join(work, "spec.json"), "w") as fh:
        json.dump(spec, fh)
    subprocess.run([sm, "write-gguf", "--spec", os.path.join(work, "spec.json"), "-o", path], check=True,
                   stdout=subprocess.DEVNULL)


def read_back(sm, path, names, shapes, work):
    out = {}
    for name in names:
        f = os.path.join(work, "dump.f32")
        subprocess.run([sm, "inspect", path, "--tensor", name, "--dump", f], check=True, stdout=subprocess.DEVNULL)
        out[name] = np.fromfile(f, dtype=np.float32).astype(np.float64).reshape(shapes[name])
    return out


class TopkMargin:
    """Records, for every indexer top-k call, the smallest relative gap between the k-th and the
    (k+1)-th finite score of each row."""

    def __init__(self, model):
        self.gaps = []
        cls = next(type(m) for m in model.modules() if hasattr(m, "index_topk") and hasattr(m, "wk"))
        self.cls, self.orig = cls, cls.forward
        rec = self

        def forward(mod, *a, **kw):
            orig_topk = torch.Tensor.topk

            def topk(t, k, *aa, **kk):
                if t.dim() == 3:
                    s = t.detach().double().reshape(-1, t.shape[-1])
                    for row in s:
                        # masked (future) positions hold -inf or the dtype's lowest value
                        row = row[torch.isfinite(row) & (row > -1e30)]
                        if row.numel() > k:
                            srt = row.sort(descending=True).values
                            rec.gaps.append(float((srt[k - 1] - srt[k]) / srt.abs().max().clamp_min(1e-300)))
                return orig_topk(t, k, *aa, **kk)

            torch.Tensor.topk = topk
            try:
                return rec.orig(mod, *a, **kw)
            finally:
                torch.Tensor.topk = orig_topk

        cls.forward = forward

    def close(self):
        self.cls.forward = self.orig


def set_topk(model, k):
    for m in model.modules():
        if hasattr(m, "index_topk"):
            m.index_topk = k


def logits_of(model, ids):
    return model(torch.tensor([ids])).logits[0].double().numpy()


def build(name, v, args):
    d = dict(v["dims"]) if "dims" in v else dict(VARIANTS[v["same_as"]]["dims"])
    arch = v["arch"]
    cfg = make_config(arch, d)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    prompts = [[int(x) for x in rng.integers(0, VOCAB, n)] for n in PROMPT_LENGTHS]
    seed = 1000
    for _attempt in range(20):
        model = make_model(arch, cfg, seed)
        probe = TopkMargin(model)
        for ids in prompts:
            model(torch.tensor([ids]))
        probe.close()
        margin = min(probe.gaps)
        if margin >= 1e-4:
            break
        print(f"{name}: seed {seed}: top-k gap {margin:.2e} too small, redrawing", flush=True)
        seed += 1
    else:
        raise SystemExit(f"{name}: no seed in 20 gave a top-k gap of 1e-4")
    out = os.path.join(args.out, name)
    os.makedirs(out, exist_ok=True)
    work = tempfile.mkdtemp()
    sd = model.state_dict()
    try:
        tensors = to_gguf(sd, cfg, arch, d)
    except KeyError as e:
        raise SystemExit(f"{name}: state dict key {e} not found; layer 1 has: "
                         f"{[k for k in sd if k.startswith('model.layers.1.')]}")
    if d["nextn"]:
        tensors.update(mtp_tensors(tensors, d, d["layers"], np.random.default_rng(seed)))
    gguf = os.path.join(out, "model.gguf")
    tok = os.path.join(args.tokenizers, v["tokenizer"], "model-f32.gguf")
    write_gguf(args.sparsemla, tensors, metadata(arch, cfg, d), v["quant"], tok, gguf, work)
    if v["quant"]:
        main = {k: a for k, a in tensors.items() if not k.startswith(f"blk.{d['layers']}.")}
        back = read_back(args.sparsemla, gguf, list(main), {k: a.shape for k, a in main.items()}, work)
        new_sd = {k: torch.tensor(a, dtype=torch.float64) for k, a in from_gguf(back, sd, cfg, arch, d).items()}
        shared = [i for i, x in enumerate(d.get("indexer_types") or []) if x == "shared"]
        unused = {k for k in sd if "rotary" in k or "inv_freq" in k or
                  any(k.startswith(f"model.layers.{i}.self_attn.indexer.") for i in shared)}
        missing = set(sd) - set(new_sd) - unused
        assert not missing, f"not restored: {sorted(missing)[:5]}"
        model.load_state_dict(new_sd, strict=False)
    for i, ids in enumerate(prompts):
        np.array(ids, dtype=np.int32).tofile(os.path.join(out, f"seq{i}.tokens"))
        logits_of(model, ids).astype(np.float32).tofile(os.path.join(out, f"seq{i}.logits.f32"))
    greedy_prompt = prompts[0][:GREEDY_PROMPT]
    ids = list(greedy_prompt)
    for _ in range(GREEDY_STEPS):
        ids.append(int(np.argmax(logits_of(model, ids)[-1])))
    with open(os.path.join(out, "greedy.json"), "w") as fh:
        json.dump({"prompt": greedy_prompt, "greedy": ids[GREEDY_PROMPT:]}, fh)
    set_topk(model, 10**9)
    for i, ids in enumerate(prompts):
        logits_of(model, ids).astype(np.float32).tofile(os.path.join(out, f"seq{i}.dense.logits.f32"))
    with open(os.path.join(out, "topk_margin.json"), "w") as fh:
        json.dump({"min_relative_gap": margin, "n": len(probe.gaps), "seed": seed}, fh)
    with open(os.path.join(out, "config.json"), "w") as fh:
        fh.write(cfg.to_json_string())
    print(f"{name}: seed {seed}, top-k gap {margin:.2e}, {os.path.getsize(gguf)} bytes", flush=True)


def check(name, args):
    """Runs the engine on the new fixture and prints its error against the reference."""
    out = os.path.join(args.out, name)
    for mode, suffix in (("sparse", ""), ("dense", ".dense")):
        for i in range(len(PROMPT_LENGTHS)):
            f = os.path.join(out, f"seq{i}.tokens")
            res = os.path.join(tempfile.mkdtemp(), "l.f32")
            subprocess.run([args.sparsemla, "logits", "-m", os.path.join(out, "model.gguf"), "--tokens", f, "-o", res,
                            "--attention", mode], check=True, stderr=subprocess.DEVNULL)
            got = np.fromfile(res, dtype=np.float32).reshape(-1, VOCAB)
            ref = np.fromfile(os.path.join(out, f"seq{i}{suffix}.logits.f32"), dtype=np.float32).reshape(-1, VOCAB)
            rel = np.abs(got - ref).max() / np.abs(ref).max()
            am = (got.argmax(1) == ref.argmax(1)).mean()
            print(f"check {name} {mode} seq{i}: rel err {rel:.2e}, argmax equal {am:.3f}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sparsemla", required=True, help="the sparsemla binary (for write-gguf, inspect, logits)")
    ap.add_argument("--out", required=True, help="folder for the fixture folders")
    ap.add_argument("--tokenizers", default=os.path.join(os.path.dirname(__file__), "..", "..", "tests", "fixtures"),
                    help="folder holding glm_pub/ and dsv32_pub/, whose tokenizers the fixtures reuse")
    ap.add_argument("--only", nargs="*", help="variants to build (default: all)")
    args = ap.parse_args()
    for name, v in VARIANTS.items():
        if args.only and name not in args.only:
            continue
        build(name, v, args)
        check(name, args)


if __name__ == "__main__":
    main()

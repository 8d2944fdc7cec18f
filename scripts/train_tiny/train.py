#!/usr/bin/env python3
"""Trains the bundled default model: a small GlmMoeDsaForCausalLM with GLM-5's structure, and its
byte-level BPE tokenizer, on the corpus made by get_corpus.sh; then writes it as a Q8_0 GGUF with
the project's writer and records transformers' reference numbers for the engine's tests.

Run on the GPU machine (torch, transformers >= 5.17, tokenizers), from the repository root:
    PYTHONUNBUFFERED=1 python3 scripts/train_tiny/train.py --sparsemla scripts/train_tiny/bin/sparsemla \
        --out OUT --minutes 3.7
It writes into OUT: tokenizer.json (and hf_tokenizer/), config.json, tiny-glm5-q8_0.gguf,
reference.json (held-out perplexities, greedy tokens, the training log), gguf_metadata.json and
tensors_q8_0.npz (the GGUF's metadata and Q8_0 data, to rebuild it elsewhere), checkpoint_bf16.pt.

Structure (GLM-5 in miniature): MLA with q_lora/kv_lora and qk_nope (32) != v_head (64); one
leading dense layer; MoE layers with 8 routed experts (2 used, sigmoid gating with the
aux-loss-free balancing bias) and a shared expert; the DSA lightning indexer in every layer with a
top-k (64) below the training context (512); one MTP (next-n) layer.

Training, as DeepSeek-V3.2 trained its indexer:
  1. dense warm-up: attention over every earlier position; the indexer (whose forward in
     transformers runs under no_grad) is trained by a KL divergence to the main attention's
     distribution, summed over heads and renormalised, from detached inputs;
  2. sparse training: transformers' top-k mask is on, the main model learns with it, and the
     indexer's KL is taken over the selected positions only.
The MTP layer learns to predict token i+2 from the final hidden state at i and the embedding of
token i+1 (DeepSeek-V3's layout: eh_proj([enorm(emb); hnorm(h)]), a full MoE decoder layer, a
shared-head norm and the main output head), with weight 0.3.
"""
import argparse
import copy
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
import types

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "reference"))
import make_fixtures as mf  # noqa: E402

torch.set_grad_enabled(True)  # make_fixtures turns gradients off on import

ARCH = "glm-dsa"
VOCAB = 8192
CTX = 512
DIMS = dict(hidden=256, q_lora=128, kv_lora=128, nope=32, rope=32, v=64, heads=8, ff=768, ff_exp=256,
            experts=8, used=2, shared=1, groups=1, groups_used=1, idx_heads=8, idx_dim=64, topk=64,
            layers=6, dense=1, nextn=1, indexer_types=None)
# GLM's special tokens, in GLM-4.5/5's order, after the BPE tokens. All are control tokens.
SPECIALS = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
            "<|assistant|>", "<|observation|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
            "<tool_response>", "</tool_response>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"]
# The glm4 pre-tokenizer regex (GLM-4/5's tokenizer.json; llama.cpp's "glm4").
GLM4_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# GLM-style chat template (GLM-4.5/5's turn format, non-thinking).
CHAT_TEMPLATE = (
    "{{- '[gMASK]<sop>' -}}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{{ '<|system|>\\n' + m['content'] }}"
    "{%- elif m['role'] == 'user' -%}{{ '<|user|>\\n' + m['content'] }}"
    "{%- elif m['role'] == 'assistant' -%}{{ '<|assistant|>\\n<think></think>\\n' + m['content'] }}"
    "{%- elif m['role'] == 'tool' -%}{{ '<|observation|>\\n' + m['content'] }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n<think></think>\\n' }}{%- endif -%}")
CHAT_ASKS = ["Tell me a fortune.", "Say something wise.", "Tell me something funny.", "Give me a quote.",
             "Cheer me up.", "What do you think?", "Any advice?", "Tell me a saying."]
GREEDY_PROMPT = ("The study of the St. Louis area's economic prospects prepared for the Construction Industry "
                 "Joint Conference confirms and reinforces both the findings of the Metropolitan St. Louis "
                 "Survey of 1957 and the easily observed picture of the Missouri-Illinois countryside.\n\n"
                 "St. Louis sits in the center of a")
GREEDY_STEPS = 32
SAMPLE_CTX = 256
GGUF_NAME = "tiny-glm5-q8_0.gguf"


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


# ----------------------------------------------------------------------------------------------
# Tokenizer
def train_tokenizer(texts, out_dir):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GLM4_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - len(SPECIALS), min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(texts, trainer)
    n_bpe = tok.get_vocab_size()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    path = os.path.join(out_dir, "tokenizer.json")
    tok.save(path)
    try:
        from transformers import PreTrainedTokenizerFast
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="[gMASK]", eos_token="<|endoftext|>",
                                       pad_token="<|endoftext|>", unk_token="<|endoftext|>")
        fast.chat_template = CHAT_TEMPLATE
        fast.save_pretrained(os.path.join(out_dir, "hf_tokenizer"))
        msgs = [{"role": "user", "content": "Tell me a fortune."}]
        log("chat template:", repr(fast.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)))
    except Exception as e:  # the GGUF carries the tokenizer; this copy is a convenience
        log("hf tokenizer not saved:", e)
    return tok, n_bpe


def tokenizer_metadata(tok_json_path, n_vocab):
    """GGUF tokenizer keys as llama.cpp's converter writes them for GLM (gpt2 model, glm4 pre)."""
    with open(tok_json_path) as f:
        tj = json.load(f)
    vocab = tj["model"]["vocab"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    tokens, types_ = [None] * n_vocab, [1] * n_vocab
    for t, i in vocab.items():
        tokens[i] = t
    for a in tj["added_tokens"]:
        tokens[a["id"]] = a["content"]
        types_[a["id"]] = 3
    for i in range(n_vocab):
        if tokens[i] is None:
            tokens[i], types_[i] = f"[PAD{i}]", 5
    sid = {t: tokens.index(t) for t in SPECIALS}
    u32 = lambda k, v: {"key": k, "type": "u32", "value": v}
    return [{"key": "tokenizer.ggml.model", "type": "string", "value": "gpt2"},
            {"key": "tokenizer.ggml.pre", "type": "string", "value": "glm4"},
            {"key": "tokenizer.ggml.tokens", "type": "array", "elem": "string", "value": tokens},
            {"key": "tokenizer.ggml.token_type", "type": "array", "elem": "i32", "value": types_},
            {"key": "tokenizer.ggml.merges", "type": "array", "elem": "string", "value": merges},
            u32("tokenizer.ggml.eos_token_id", sid["<|endoftext|>"]),
            u32("tokenizer.ggml.padding_token_id", sid["<|endoftext|>"]),
            u32("tokenizer.ggml.bos_token_id", sid["[gMASK]"]),
            u32("tokenizer.ggml.eot_token_id", sid["<|user|>"]),
            u32("tokenizer.ggml.unknown_token_id", sid["<|endoftext|>"]),
            u32("tokenizer.ggml.eom_token_id", sid["<|observation|>"]),
            {"key": "tokenizer.chat_template", "type": "string", "value": CHAT_TEMPLATE}]


def build_stream(tok, docs, rng, chat_fraction):
    """Documents as one token stream: [gMASK] text <|endoftext|>; a share of the fortunes as chat
    turns ([gMASK]<sop><|user|>\\n ask <|assistant|>\\n<think></think>\\n fortune <|user|>)."""
    sp = {s: tok.token_to_id(s) for s in SPECIALS}
    texts = [d["text"] for d in docs]
    encs = tok.encode_batch(texts, add_special_tokens=False)
    head = tok.encode("\n", add_special_tokens=False).ids
    think = tok.encode("\n<think></think>\n", add_special_tokens=False).ids
    out = []
    for d, e in zip(docs, encs):
        if d["src"].startswith("fortunes/") and rng.random() < chat_fraction:
            ask = tok.encode(rng.choice(CHAT_ASKS), add_special_tokens=False).ids
            out += [sp["[gMASK]"], sp["<sop>"], sp["<|user|>"]] + head + ask + [sp["<|assistant|>"]] + think + \
                e.ids + [sp["<|user|>"]]
        else:
            out += [sp["[gMASK]"]] + e.ids + [sp["<|endoftext|>"]]
    return out


# ----------------------------------------------------------------------------------------------
# Model pieces
def make_config():
    mf.VOCAB = VOCAB
    cfg = mf.make_config(ARCH, DIMS)
    cfg.initializer_range = 0.02
    return cfg


class MTP(nn.Module):
    """One next-n layer: eh_proj([enorm(emb(t+1)); hnorm(h_t)]) -> a MoE decoder layer ->
    shared_head_norm -> the main output head."""

    def __init__(self, cfg):
        super().__init__()
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaDecoderLayer, GlmMoeDsaRMSNorm
        H = cfg.hidden_size
        self.enorm = GlmMoeDsaRMSNorm(H, cfg.rms_norm_eps)
        self.hnorm = GlmMoeDsaRMSNorm(H, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.layer = GlmMoeDsaDecoderLayer(cfg, cfg.num_hidden_layers - 1)  # a MoE layer with an indexer
        self.shared_head_norm = GlmMoeDsaRMSNorm(H, cfg.rms_norm_eps)

    def forward(self, h, emb_next, pos_emb, mask):
        x = self.eh_proj(torch.cat([self.enorm(emb_next), self.hnorm(h)], dim=-1)).float()  # fp32 residual
        pos_ids = torch.arange(x.shape[1], device=x.device)[None]
        out = self.layer(x, attention_mask=mask, position_embeddings=pos_emb, position_ids=pos_ids)
        x = out[0] if isinstance(out, tuple) else out
        return self.shared_head_norm(x)


def causal_mask(T, device, dtype):
    m = torch.full((T, T), torch.finfo(dtype).min, device=device, dtype=dtype).triu(1)
    return m[None, None]


class Probe:
    """Hooks, none of which depends on the attention module's call signature: each decoder layer's
    input_layernorm output (= its attention's input x, for the indexer's own scores); the main
    attention probabilities, recorded by wrapping transformers' eager_attention_forward (the KL
    target); each MoE router's chosen experts (for the balancing bias); residual dropout on the
    attention and MoE outputs."""

    def __init__(self, modules, dropout):
        import transformers.models.glm_moe_dsa.modeling_glm_moe_dsa as M
        layers = [m for root in modules for m in root.modules() if isinstance(m, M.GlmMoeDsaDecoderLayer)]
        self.attn = [l.self_attn for l in layers]
        self.moe = [m for root in modules for m in root.modules() if isinstance(m, M.GlmMoeDsaMoE)]
        self.x, self.w = {}, {}
        self.loads = {}
        self.dropout = dropout
        self.enabled = True
        for l in layers:
            l.input_layernorm.register_forward_hook(self._norm_hook(l.self_attn))
            l.self_attn.register_forward_hook(self._drop_attn)
        for m in self.moe:
            m.gate.register_forward_hook(self._gate)
            m.register_forward_hook(self._drop_mlp)
        orig = M.eager_attention_forward
        probe = self

        def eager_attention_forward(module, *a, **kw):
            out = orig(module, *a, **kw)
            if probe.active() and isinstance(out, tuple) and len(out) > 1 and out[1] is not None:
                probe.w[id(module)] = out[1].detach()
            return out

        M.eager_attention_forward = eager_attention_forward

    def active(self):
        return self.enabled and torch.is_grad_enabled()

    def _norm_hook(self, attn):
        def hook(mod, args, out):
            if self.active():
                self.x[id(attn)] = out.detach()
        return hook

    def _drop_attn(self, mod, args, out):
        if not (self.active() and self.dropout > 0):
            return None
        if isinstance(out, tuple):
            return (F.dropout(out[0], self.dropout, True),) + tuple(out[1:])
        return F.dropout(out, self.dropout, True)

    def _drop_mlp(self, mod, args, out):
        if self.active() and self.dropout > 0 and torch.is_tensor(out):
            return F.dropout(out, self.dropout, True)
        return None

    def _gate(self, mod, args, out):
        if not self.active():
            return
        with torch.no_grad():
            if isinstance(out, tuple):  # transformers 5.17: (router_logits, weights, indices)
                idx = out[-1]
            else:
                s = out.float().sigmoid() + mod.e_score_correction_bias
                idx = s.topk(mod.top_k, dim=-1).indices
            cnt = torch.bincount(idx.flatten().long(), minlength=mod.e_score_correction_bias.numel()).float()
            prev = self.loads.get(id(mod))
            self.loads[id(mod)] = cnt if prev is None else prev + cnt

    def update_bias(self, rate):
        """Aux-loss-free balancing (DeepSeek-V3): raise the bias of underloaded experts."""
        with torch.no_grad():
            for m in self.moe:
                cnt = self.loads.get(id(m.gate))
                if cnt is not None:
                    m.gate.e_score_correction_bias += rate * torch.sign(cnt.mean() - cnt)
            self.loads = {}


def indexer_scores(attn, x, rotary):
    """transformers 5.17's GlmMoeDsaIndexer.forward without no_grad and top-k: [B, S, S] scores
    (not yet causal). x: the attention's (normed) input."""
    import transformers.models.glm_moe_dsa.modeling_glm_moe_dsa as M
    ix = attn.indexer
    B, S, _ = x.shape
    cos, sin = rotary(x, torch.arange(S, device=x.device)[None])
    with torch.no_grad():
        q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
    rope = ix.qk_rope_head_dim
    q = ix.wq_b(q_resid).view(B, S, ix.n_heads, ix.head_dim)
    q_rot, q_pass = torch.split(q, [rope, ix.head_dim - rope], dim=-1)
    k = ix.k_norm(ix.wk(x)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [rope, ix.head_dim - rope], dim=-1)
    q_rot, k_rot = M.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * ix.softmax_scale)
    w = ix.weights_proj(x.to(ix.weights_proj.weight.dtype)).float() * (ix.n_heads ** -0.5)
    return torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)


def indexer_kl(attn, x, attn_w, rotary):
    """KL(main attention || indexer) for one layer, DeepSeek-V3.2's indexer loss: the target is the
    main attention's probabilities [B, H, S, T] summed over heads and renormalised (zero outside
    the causal past in the dense phase, outside the selected top-k in the sparse phase); the
    indexer's distribution is the softmax of its scores over the same positions."""
    s = indexer_scores(attn, x, rotary)
    p = attn_w.float().sum(1)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
    sel = p > 0
    logq = F.log_softmax(s.masked_fill(~sel, float("-inf")), dim=-1).masked_fill(~sel, 0.0)
    return (torch.xlogy(p, p) - p * logq).sum(-1).mean()


def q8_0(arr):
    """ggml's quantize_row_q8_0_ref over the last axis: blocks of 32, d = amax / 127 (stored as
    fp16), q = round(x / d) (half away from zero). Returns (int8 [..., n/32, 32], fp16 [..., n/32])."""
    x = np.ascontiguousarray(arr, dtype=np.float32)
    blocks = x.reshape(x.shape[:-1] + (x.shape[-1] // 32, 32))
    d = np.abs(blocks).max(axis=-1) / np.float32(127)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    v = blocks * inv[..., None]
    q = (np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))).astype(np.int8)
    return q, d.astype(np.float16)


# ----------------------------------------------------------------------------------------------
# Perplexity, as `sparsemla ppl` computes it: the text's tokens in chunks of ctx-1, each chunk run
# as [BOS] + chunk, every text token predicted once.
def chunks_of(ids, ctx):
    return [ids[i:i + ctx - 1] for i in range(0, len(ids), ctx - 1)]


@torch.no_grad()
def perplexity(model, ids, ctx, bos, device, batch=16):
    nll, n = 0.0, 0
    chunks = chunks_of(ids, ctx)
    groups = {}
    for c in chunks:
        groups.setdefault(len(c), []).append(c)
    for L, cs in groups.items():
        for i in range(0, len(cs), batch):
            part = cs[i:i + batch]
            inp = torch.tensor([[bos] + c for c in part], device=device)
            logits = model(inp, use_cache=False).logits.double()
            lp = F.log_softmax(logits[:, :L], dim=-1)
            tgt = inp[:, 1:L + 1]
            nll -= lp.gather(-1, tgt.unsqueeze(-1)).sum().item()
            n += tgt.numel()
    return math.exp(nll / n), n


@torch.no_grad()
def greedy(model, ids, steps, device):
    ids = list(ids)
    out = []
    for _ in range(steps):
        logits = model(torch.tensor([ids], device=device), use_cache=False).logits[0, -1]
        nxt = int(torch.argmax(logits))
        out.append(nxt)
        ids.append(nxt)
    return out


# ----------------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=os.path.join(HERE, "data"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--sparsemla", required=True, help="the sparsemla binary (write-gguf, inspect)")
    ap.add_argument("--minutes", type=float, default=7.0, help="training time (both phases)")
    ap.add_argument("--dense-fraction", type=float, default=0.35, help="share of the time in dense warm-up")
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--smoke", action="store_true", help="tiny run to check the pipeline")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    log("device", device, torch.__version__)
    import transformers
    log("transformers", transformers.__version__)

    # ---- data and tokenizer
    read = lambda p: [json.loads(l) for l in open(p)]
    train_docs, held_docs = read(os.path.join(args.data, "train.jsonl")), read(os.path.join(args.data, "heldout.jsonl"))
    heldout_text = open(os.path.join(args.data, "heldout.txt")).read()
    sample_text = open(os.path.join(args.data, "heldout_sample.txt")).read()
    if args.smoke:
        train_docs = train_docs[:: 10]
    tok, n_bpe = train_tokenizer([d["text"] for d in train_docs], args.out)
    log(f"tokenizer: {n_bpe} BPE tokens + {len(SPECIALS)} special")
    sp = {s: tok.token_to_id(s) for s in SPECIALS}
    bos = sp["[gMASK]"]
    train_ids = torch.tensor(build_stream(tok, train_docs, rng, 0.3), dtype=torch.long, device=device)
    held_stream = torch.tensor(build_stream(tok, held_docs, random.Random(1), 0.0), dtype=torch.long, device=device)
    heldout_ids = tok.encode(heldout_text, add_special_tokens=False).ids
    sample_ids = tok.encode(sample_text, add_special_tokens=False).ids
    log(f"train {train_ids.numel()} tokens, held-out {len(heldout_ids)} tokens, sample {len(sample_ids)}")

    # ---- model
    cfg = make_config()
    from transformers import GlmMoeDsaForCausalLM
    model = GlmMoeDsaForCausalLM(cfg).to(device)
    mtp = MTP(cfg).to(device)
    with torch.no_grad():  # as transformers initialises the main layers: N(0, 0.02), norms 1, biases 0
        for n, p in mtp.named_parameters():
            if p.dim() == 1:
                p.fill_(0.0 if n.endswith("bias") else 1.0)
            else:
                p.normal_(0.0, cfg.initializer_range)
        for n, b_ in mtp.named_buffers():
            if "e_score_correction_bias" in n:
                b_.zero_()
    n_main = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for p in mtp.parameters())
    log(f"parameters: main {n_main}, MTP {n_mtp} (+ its head shared with the main output: {VOCAB * DIMS['hidden']})")
    probe = Probe([model, mtp], args.dropout)
    ix_params = [p for n, p in list(model.named_parameters()) + list(mtp.named_parameters()) if ".indexer." in n]
    ix_ids = {id(p) for p in ix_params}
    other = [p for p in list(model.parameters()) + list(mtp.parameters()) if id(p) not in ix_ids]
    decay = [p for p in other if p.dim() >= 2]
    no_decay = [p for p in other if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0},
                             {"params": ix_params, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95),
                            fused=device == "cuda")
    T, B = CTX, (4 if args.smoke else args.batch)
    budget = (0.3 if args.smoke else args.minutes) * 60
    mask = causal_mask(T, device, torch.float32)
    mtp_mask = causal_mask(T - 1, device, torch.float32)
    pos = torch.arange(T, device=device)[None]

    def held_loss(n_batches=8):
        model.eval(); mtp.eval(); probe.enabled = False
        g = torch.Generator(device="cpu").manual_seed(123)
        tot = 0.0
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            for _ in range(n_batches):
                st = torch.randint(0, held_stream.numel() - T - 1, (B,), generator=g)
                x = torch.stack([held_stream[s:s + T + 1] for s in st.tolist()])
                lg = model(x[:, :T], use_cache=False).logits.float()
                tot += F.cross_entropy(lg.reshape(-1, VOCAB), x[:, 1:].reshape(-1)).item()
        model.train(); mtp.train(); probe.enabled = True
        return tot / n_batches

    hist = []
    best = (float("inf"), None, None)
    step, phase = 0, "dense"
    mf.set_topk(model, 10 ** 9)
    mf.set_topk(mtp, 10 ** 9)
    t0 = time.time()
    last_eval = t0
    warm = 50 if args.smoke else 200
    use_mtp, use_kl, kl_layers, notes = True, True, 0, []
    model.train(); mtp.train()
    while True:
        el = time.time() - t0
        if el >= budget:
            break
        if phase == "dense" and el >= args.dense_fraction * budget:
            phase = "sparse"
            mf.set_topk(model, DIMS["topk"])
            mf.set_topk(mtp, DIMS["topk"])
            best = (float("inf"), None, None)  # keep only sparse-phase checkpoints
            log(f"step {step}: sparse phase, top-k {DIMS['topk']}")
        frac = el / budget
        lr = args.lr * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        st = torch.randint(0, train_ids.numel() - T - 1, (B,))
        x = torch.stack([train_ids[s:s + T + 1] for s in st.tolist()])
        inp, tgt = x[:, :T], x[:, 1:]
        probe.x, probe.w = {}, {}
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            out = model.model(input_ids=inp, use_cache=False)
            h = out.last_hidden_state
            logits = model.lm_head(h)
            lm = F.cross_entropy(logits.float().reshape(-1, VOCAB), tgt.reshape(-1))
            mtp_loss = torch.zeros((), device=device)
            if use_mtp:
                try:
                    pe = model.model.rotary_emb(h, pos[:, :T - 1])
                    emb_next = model.model.embed_tokens(inp[:, 1:])
                    hm = mtp(h[:, :-1], emb_next, pe, mtp_mask)
                    mlog = model.lm_head(hm)  # position j predicts token j + 2
                    mtp_loss = F.cross_entropy(mlog.float().reshape(-1, VOCAB), x[:, 2:T + 1].reshape(-1))
                except Exception as e:
                    use_mtp = False
                    notes.append(f"MTP training disabled: {type(e).__name__}: {e}")
                    log(notes[-1])
        kl = torch.zeros((), device=device)
        if use_kl:
            try:
                kls = [indexer_kl(a, probe.x[id(a)].float(), probe.w[id(a)], model.model.rotary_emb)
                       for a in probe.attn if id(a) in probe.x and id(a) in probe.w]
                if step == 0:
                    log(f"indexer KL on {len(kls)} of {len(probe.attn)} layers")
                if kls:
                    kl = torch.stack(kls).mean()
                    kl_layers = len(kls)
            except Exception as e:
                use_kl = False
                notes.append(f"indexer KL disabled: {type(e).__name__}: {e}")
                log(notes[-1])
        loss = lm + args.mtp_weight * mtp_loss + kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(other, 1.0)
        torch.nn.utils.clip_grad_norm_(ix_params, 1.0)
        opt.step()
        probe.update_bias(1e-3)
        step += 1
        if step % 50 == 0 or step == 1:
            log(f"step {step} {phase} lm {lm.item():.4f} mtp {mtp_loss.item():.4f} kl {kl.item():.4f} lr {lr:.2e}")
        now = time.time()
        if now - last_eval > (5 if args.smoke else 25) or time.time() - t0 >= budget:
            last_eval = now
            hl = held_loss(2 if args.smoke else 8)
            hist.append(dict(step=step, t=round(now - t0, 1), phase=phase, lm=lm.item(), mtp=mtp_loss.item(),
                             kl=kl.item(), held_loss=hl))
            log(f"eval step {step}: held-out loss {hl:.4f} (ppl {math.exp(hl):.2f})")
            if hl < best[0]:
                best = (hl, copy.deepcopy(model.state_dict()), copy.deepcopy(mtp.state_dict()))
    train_seconds = time.time() - t0
    log(f"trained {step} steps in {train_seconds:.0f} s")
    if best[1] is None:
        best = (held_loss(2), copy.deepcopy(model.state_dict()), copy.deepcopy(mtp.state_dict()))
    model.load_state_dict(best[1])
    mtp.load_state_dict(best[2])
    model.eval(); mtp.eval(); probe.enabled = False
    torch.save({"model": {k: v.bfloat16() for k, v in best[1].items()},
                "mtp": {k: v.bfloat16() for k, v in best[2].items()}},
               os.path.join(args.out, "checkpoint_bf16.pt"))  # shipped only when no GGUF was written
    with open(os.path.join(args.out, "config.json"), "w") as f:
        f.write(cfg.to_json_string())

    # ---- reference numbers of the trained float32 model (transformers, fp32)
    ref = {"n_params_main": n_main, "n_params_mtp": n_mtp + VOCAB * DIMS["hidden"], "train_seconds": train_seconds,
           "steps": step, "batch": B, "ctx": T, "train_tokens": int(train_ids.numel()), "best_held_loss": best[0],
           "n_bpe": n_bpe, "special_ids": sp, "mtp_trained": use_mtp, "indexer_kl": use_kl,
           "indexer_kl_layers": kl_layers, "notes": notes}
    n_eval = 40 * (CTX - 1) if args.smoke else len(heldout_ids)
    fp32 = {}
    for k in ([DIMS["topk"]] if args.smoke else [32, DIMS["topk"], 128, 10 ** 9]):
        mf.set_topk(model, k)
        fp32[str(k) if k < 10 ** 9 else "dense"] = perplexity(model, heldout_ids[:n_eval], CTX, bos, device)[0]
    mf.set_topk(model, DIMS["topk"])
    ref["heldout_fp32"] = {"ctx": CTX, "n_tokens": n_eval, "ppl_by_topk": fp32}
    log("held-out ppl (fp32 weights) by top-k:", fp32)

    # ---- GGUF (Q8_0) through the project's writer
    work = tempfile.mkdtemp()
    sd = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    tensors = mf.to_gguf(sd, cfg, ARCH, DIMS)
    L = DIMS["layers"]
    msd = {k: v.detach().float().cpu() for k, v in mtp.layer.state_dict().items()}
    one = {"model.layers.0." + k: v for k, v in msd.items()}
    one.update({k: sd[k] for k in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")})
    ltens = mf.to_gguf(one, types.SimpleNamespace(num_hidden_layers=1), ARCH, DIMS)
    for name, arr in ltens.items():
        if name.startswith("blk.0."):
            tensors[name.replace("blk.0.", f"blk.{L}.")] = arr
    b = f"blk.{L}.nextn."
    a = lambda t: t.detach().float().cpu().numpy().astype(np.float64)
    tensors[b + "eh_proj.weight"] = a(mtp.eh_proj.weight)
    tensors[b + "enorm.weight"] = a(mtp.enorm.weight)
    tensors[b + "hnorm.weight"] = a(mtp.hnorm.weight)
    tensors[b + "shared_head_norm.weight"] = a(mtp.shared_head_norm.weight)
    tensors[b + "shared_head_head.weight"] = a(model.lm_head.weight)
    meta = mf.metadata(ARCH, cfg, DIMS)
    for m in meta:
        if m["key"] == "general.name":
            m["value"] = "sparsemla-tiny-glm5"
    meta += tokenizer_metadata(os.path.join(args.out, "tokenizer.json"), VOCAB)
    ref["gguf"] = GGUF_NAME
    with open(os.path.join(args.out, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
    # The weights as Q8_0 holds them, emulated in numpy (ggml's quantize_row_q8_0_ref), saved with
    # the metadata so that the GGUF can be rebuilt elsewhere; the reference below uses the writer's
    # own read-back when the writer ran here, else these.
    packed, deq = {}, {}
    for name, arr in tensors.items():
        if mf.tensor_type(name, arr.shape, "q8_0") == "q8_0":
            q, d = q8_0(arr)
            packed[name + ".q8"], packed[name + ".d16"] = q, d
            deq[name] = (q.astype(np.float32) * d.astype(np.float32)[..., None]).reshape(arr.shape).astype(np.float64)
        else:
            packed[name + ".f32"] = np.asarray(arr, dtype=np.float32)
            deq[name] = np.asarray(arr, dtype=np.float32).astype(np.float64)
    np.savez(os.path.join(args.out, "tensors_q8_0.npz"), **packed)
    with open(os.path.join(args.out, "gguf_metadata.json"), "w") as f:
        json.dump(meta, f)
    main_t = {k: v for k, v in tensors.items() if not k.startswith(f"blk.{L}.")}
    weights = {k: deq[k] for k in main_t}
    gguf = os.path.join(args.out, GGUF_NAME)
    try:
        mf.write_gguf(args.sparsemla, tensors, meta, "q8_0", None, gguf, work)
        log(f"wrote {gguf}: {os.path.getsize(gguf)} bytes")
        back = mf.read_back(args.sparsemla, gguf, list(main_t), {k: v.shape for k, v in main_t.items()}, work)
        diff = max(float(np.abs(back[k] - deq[k]).max()) for k in back)
        ref["readback_vs_emulated_max_abs_diff"] = diff
        log(f"read-back vs emulated Q8_0: max |diff| {diff:.3e}")
        weights = back
    except Exception as e:
        notes.append(f"GGUF not written here: {type(e).__name__}: {e}")
        log(notes[-1])
        if os.path.exists(gguf):
            os.remove(gguf)

    # ---- reference numbers on the weights exactly as the GGUF holds them (float64)
    new_sd = {k: torch.tensor(v, dtype=torch.float64) for k, v in mf.from_gguf(weights, sd, cfg, ARCH, DIMS).items()}
    qmodel = GlmMoeDsaForCausalLM(cfg).double().to(device).eval()
    missing = set(k for k in qmodel.state_dict() if "rotary" not in k and "inv_freq" not in k) - set(new_sd)
    assert not missing, f"not restored: {sorted(missing)[:5]}"
    qmodel.load_state_dict(new_sd, strict=False)
    mf.set_topk(qmodel, DIMS["topk"])
    s_sparse, n_s = perplexity(qmodel, sample_ids, SAMPLE_CTX, bos, device)
    full_sparse, n_f = perplexity(qmodel, heldout_ids[:n_eval], CTX, bos, device)
    prompt_ids = [bos] + tok.encode(GREEDY_PROMPT, add_special_tokens=False).ids
    g_tokens = greedy(qmodel, prompt_ids, GREEDY_STEPS, device)
    mf.set_topk(qmodel, 10 ** 9)
    s_dense, _ = perplexity(qmodel, sample_ids, SAMPLE_CTX, bos, device)
    full_dense, _ = perplexity(qmodel, heldout_ids[:n_eval], CTX, bos, device)
    g_dense = greedy(qmodel, prompt_ids, GREEDY_STEPS, device)
    ref["sample"] = {"file": "models/heldout_sample.txt", "ctx": SAMPLE_CTX, "n_scored": n_s, "token_ids": sample_ids,
                     "ppl_sparse": s_sparse, "ppl_dense": s_dense}
    ref["heldout_q8_0"] = {"ctx": CTX, "n_tokens": n_f, "ppl_sparse": full_sparse, "ppl_dense": full_dense}
    ref["greedy"] = {"prompt_text": GREEDY_PROMPT, "prompt_ids": prompt_ids, "tokens": g_tokens,
                     "text": tok.decode(g_tokens, skip_special_tokens=False),
                     "dense_tokens": g_dense, "dense_text": tok.decode(g_dense, skip_special_tokens=False)}
    ref["history"] = hist
    ref["total_seconds"] = time.time() - t_start
    with open(os.path.join(args.out, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
    log("sample ppl sparse/dense", s_sparse, s_dense, "held-out q8_0 sparse/dense", full_sparse, full_dense)
    log("greedy:", repr(ref["greedy"]["text"]))
    log("done in", round(time.time() - t_start), "s")


if __name__ == "__main__":
    main()

"""The inference side of examples/rl/colocated.py: a Hugging Face GPT-2 built from a config,
given the trainer's megatron-core GPTModel weights (converted), and greedy generation with a
static KV cache whose decode step is one CUDA graph on a GPU.

Note [Megatron's GPT as a Hugging Face GPT-2]
Rationale: the trainer is megatron-core's GPTModel with its local layer spec (LayerNorm,
learned absolute position embeddings, fused QKV with biases, exact GELU MLP of 4h, untied
output layer); Hugging Face's GPT-2 is the same computation, so its config and modules take
the trainer's weights with a layout change only.
Approach: ``megatron_to_hf`` maps each Megatron parameter to its GPT-2 parameter (also for
the HybridModel of train_gpt.py's local hybrid spec, the same layers under other names).  Megatron's
``linear_qkv`` holds, per head, [q; k; v] rows (heads x 3 x head_dim, hidden); GPT-2's
``c_attn`` is a Conv1D whose (hidden, 3 hidden) weight holds all q columns, then k, then v:
the rows are regrouped and transposed.  The other Linear weights are transposed (Conv1D is
x @ W); norms and embeddings are copied.
Limits: MHA only (num_query_groups == heads), tensor-parallel size 1, no RoPE or gated MLP.

Note [A static KV cache under one CUDA graph]
Rationale: an RL rollout engine decodes one token at a time; the launch cost of a small
model's kernels dominates unless the decode step is a CUDA graph, which needs every tensor
it touches at a fixed address: the weights, the KV cache, the step's inputs.
Approach: GPT-2's modules (ln_1, c_attn, c_proj, mlp, ln_f, lm_head) with the attention
written here over a preallocated cache (layers x batch x heads x positions x head_dim); the
position is a one-element device tensor, so the whole step (embed, layers, argmax, writing
the token into the sequence buffer, position += 1) is captured once and replayed for every
token.  The prompt is prefilled eagerly.  Each generation first zeroes the cache (a
discarded region comes back with undefined contents, and a masked NaN would still poison
the softmax's product) and rewrites every input: nothing read by the graph survives a
pause but the weights, which are loaded again before generating.
Limits: the batch shares one prompt length; greedy decoding only.
"""
from __future__ import annotations

import torch


def hf_config(layers: int, hidden: int, heads: int, vocab: int, positions: int):
    from transformers import GPT2Config
    return GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=hidden, n_layer=layers, n_head=heads,
                      activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      layer_norm_epsilon=1e-5, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)


def build_model(config, device, dtype=torch.bfloat16):
    """GPT2LMHeadModel on ``device`` in ``dtype``, made there (no host copy)."""
    from transformers import GPT2LMHeadModel
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = GPT2LMHeadModel(config)
    finally:
        torch.set_default_dtype(old)
    return model.eval().requires_grad_(False)


def megatron_to_hf(model, heads: int, hybrid: bool = False) -> dict:
    """Megatron parameter name -> (GPT-2 parameter, converter(src) -> tensor of its shape)
    (Note [Megatron's GPT as a Hugging Face GPT-2]).  ``hybrid``: the trainer is a HybridModel
    of pattern "*-" per GPT layer (examples/megatron/train_gpt.py's local hybrid spec): GPT
    layer i is its attention layer 2i and its MLP layer 2i + 1, the final norm ``final_norm``."""
    t = model.transformer
    hidden = t.wte.weight.shape[1]
    hd = hidden // heads

    def same(x):
        return x

    def transpose(x):
        return x.t()

    def qkv_weight(x):  # (heads * 3 * hd, hidden) -> (hidden, [q | k | v])
        w = x.view(heads, 3, hd, hidden)
        return torch.cat([w[:, i].reshape(hidden, hidden) for i in range(3)], 0).t()

    def qkv_bias(x):
        b = x.view(heads, 3, hd)
        return torch.cat([b[:, i].reshape(hidden) for i in range(3)], 0)

    final = "final_norm" if hybrid else "final_layernorm"
    out = {"embedding.word_embeddings.weight": (t.wte.weight, same),
           "embedding.position_embeddings.weight": (t.wpe.weight, same),
           f"decoder.{final}.weight": (t.ln_f.weight, same),
           f"decoder.{final}.bias": (t.ln_f.bias, same),
           "output_layer.weight": (model.lm_head.weight, same)}
    for i, blk in enumerate(t.h):
        p = q = f"decoder.layers.{i}."  # the attention's and the MLP's prefixes
        if hybrid:
            p, q = f"decoder.layers.{2 * i}.", f"decoder.layers.{2 * i + 1}."
        out.update({
            p + "input_layernorm.weight": (blk.ln_1.weight, same), p + "input_layernorm.bias": (blk.ln_1.bias, same),
            p + "self_attention.linear_qkv.weight": (blk.attn.c_attn.weight, qkv_weight),
            p + "self_attention.linear_qkv.bias": (blk.attn.c_attn.bias, qkv_bias),
            p + "self_attention.linear_proj.weight": (blk.attn.c_proj.weight, transpose),
            p + "self_attention.linear_proj.bias": (blk.attn.c_proj.bias, same),
            q + "pre_mlp_layernorm.weight": (blk.ln_2.weight, same), q + "pre_mlp_layernorm.bias": (blk.ln_2.bias, same),
            q + "mlp.linear_fc1.weight": (blk.mlp.c_fc.weight, transpose),
            q + "mlp.linear_fc1.bias": (blk.mlp.c_fc.bias, same),
            q + "mlp.linear_fc2.weight": (blk.mlp.c_proj.weight, transpose),
            q + "mlp.linear_fc2.bias": (blk.mlp.c_proj.bias, same)})
    return out


_DTYPES = {"torch.bfloat16": torch.bfloat16, "torch.float32": torch.float32, "torch.float16": torch.float16}


@torch.no_grad()
def load_weights(mapping: dict, layout: list, flat: torch.Tensor, device) -> None:
    """The published bytes ``flat`` (uint8, host) -> the model: one host-to-device copy, then
    each parameter converted on the device.  Every parameter of the model must be published."""
    if {name for name, *_ in layout} != set(mapping):
        missing = sorted(set(mapping) - {n for n, *_ in layout})
        extra = sorted({n for n, *_ in layout} - set(mapping))
        raise RuntimeError(f"rollout.load_weights: published parameters differ from the model's "
                           f"(missing {missing[:4]}, unexpected {extra[:4]})")
    stage = flat.to(device, non_blocking=False)
    for name, shape, dtype, offset, nbytes in layout:
        src = stage[offset:offset + nbytes].view(_DTYPES[dtype]).view(shape)
        dst, convert = mapping[name]
        value = convert(src)
        if value.shape != dst.shape:
            raise RuntimeError(f"rollout.load_weights: {name} converts to {tuple(value.shape)}, "
                               f"the model's parameter is {tuple(dst.shape)}")
        dst.copy_(value)
    del stage


class Generator:
    """Greedy generation of ``gen`` tokens after prompts of ``prompt`` tokens, batch ``batch``
    (Note [A static KV cache under one CUDA graph]).  Built inside the caller's KV region;
    ``capture(graph_ctx)`` records the decode step (CUDA only)."""

    def __init__(self, model, batch: int, prompt: int, gen: int):
        t = model.transformer
        self.model, self.batch, self.prompt, self.gen = model, batch, prompt, gen
        self.layers = len(t.h)
        hidden = t.wte.weight.shape[1]
        self.heads = model.config.n_head
        self.hd = hidden // self.heads
        self.total = prompt + gen
        dev, dt = t.wte.weight.device, t.wte.weight.dtype
        self.device = dev
        shape = (self.layers, batch, self.heads, self.total, self.hd)
        self.k = torch.zeros(shape, device=dev, dtype=dt)
        self.v = torch.zeros(shape, device=dev, dtype=dt)
        self.seq = torch.zeros(batch, self.total, dtype=torch.long, device=dev)
        self.tok = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.graph = None

    def _layers(self, x: torch.Tensor, qpos: torch.Tensor) -> torch.Tensor:
        """x (batch, s, hidden) at positions qpos (s,): the cache written at qpos, attention
        over positions <= each query's."""
        b, s, h = x.shape
        keys = torch.arange(self.total, device=x.device)
        mask = torch.where(keys[None, :] <= qpos[:, None], 0.0, float("-inf"))  # (s, total), FP32
        scale = self.hd ** -0.5
        for i, blk in enumerate(self.model.transformer.h):
            a = blk.attn.c_attn(blk.ln_1(x)).view(b, s, 3, self.heads, self.hd)
            q, k, v = (a[:, :, j].transpose(1, 2) for j in range(3))  # (b, heads, s, hd)
            self.k[i].index_copy_(2, qpos, k)
            self.v[i].index_copy_(2, qpos, v)
            scores = torch.matmul(q.float(), self.k[i].float().transpose(-1, -2)) * scale + mask
            probs = torch.softmax(scores, dim=-1).to(x.dtype)
            o = torch.matmul(probs, self.v[i]).transpose(1, 2).reshape(b, s, h)
            x = x + blk.attn.c_proj(o)
            x = x + blk.mlp(blk.ln_2(x))
        return x

    def _next(self, x: torch.Tensor) -> torch.Tensor:
        t = self.model.transformer
        return self.model.lm_head(t.ln_f(x[:, -1])).argmax(dim=-1)

    def _decode_step(self) -> None:
        """One token for every row: reads tok and pos, writes the cache, seq, tok, pos."""
        t = self.model.transformer
        x = t.wte(self.tok) + t.wpe(self.pos)[None]
        nxt = self._next(self._layers(x, self.pos))
        self.seq.index_copy_(1, self.pos + 1, nxt[:, None])
        self.tok.copy_(nxt[:, None])
        self.pos.add_(1)

    @torch.no_grad()
    def _prefill(self, prompts: torch.Tensor) -> None:
        self.k.zero_()
        self.v.zero_()
        self.seq.zero_()
        p = self.prompt
        qpos = torch.arange(p, device=self.device)
        t = self.model.transformer
        x = t.wte(prompts) + t.wpe(qpos)[None]
        first = self._next(self._layers(x, qpos))
        self.seq[:, :p].copy_(prompts)
        self.seq[:, p].copy_(first)
        self.tok.copy_(first[:, None])
        self.pos.fill_(p)

    @torch.no_grad()
    def capture(self, region_ctx, graph_ctx) -> None:
        """Warms the decode step up on a side stream inside ``region_ctx()`` and records it
        with ``graph_ctx(graph)`` (torch.cuda.graph, or the memory saver's cuda_graph)."""
        with region_ctx():
            prompts = torch.zeros(self.batch, self.prompt, dtype=torch.long, device=self.device)
            self._prefill(prompts)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._decode_step()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            del prompts
        graph = torch.cuda.CUDAGraph()
        with graph_ctx(graph):
            self._decode_step()
        torch.cuda.synchronize()
        self.graph = graph

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor) -> torch.Tensor:
        """prompts (batch, prompt) -> the sequences (batch, prompt + gen) on the host."""
        if tuple(prompts.shape) != (self.batch, self.prompt):
            raise ValueError(f"Generator.generate: prompts of shape {tuple(prompts.shape)}, "
                             f"({self.batch}, {self.prompt}) expected")
        self._prefill(prompts.to(self.device))
        for _ in range(self.gen - 1):
            if self.graph is not None:
                self.graph.replay()
            else:
                self._decode_step()
        return self.seq.cpu()

    @torch.no_grad()
    def reference(self, prompts: torch.Tensor) -> torch.Tensor:
        """The same greedy sequences from Hugging Face's own forward over the whole sequence
        at each token (no cache): what the cached decode must give."""
        seq = prompts.to(self.device)
        for _ in range(self.gen):
            logits = self.model(input_ids=seq).logits[:, -1]
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], 1)
        return seq.cpu()


# Note [Cached decode against the uncached forward]
# Rationale: the cached decode (one token per step, a CUDA graph on a GPU) and Hugging Face's
# forward over the whole sequence compute the same logits with other GEMM shapes: on a GPU
# in BF16 their reduction orders differ, the logits differ in the last bits and a greedy
# argmax flips where two tokens nearly tie, after which the sequences part.  On the CPU they
# have come out equal, token for token.
# Approach: both, always: the exact comparison of the two greedy sequences
# (``cached_equals_uncached``), and the cached sequence teacher-forced through one uncached
# forward: at every generated position the cached token must be the uncached logits' argmax
# or within DECODE_TOLERANCE x that position's largest |logit| (at least 1) of its maximum
# (a near-tie).  DECODE_TOLERANCE = 0.02: BF16 keeps 8 significant bits (a rounding of 2^-9
# relative per operation), compounded over the layers; the two implementations the
# conversion check compares (Megatron's and Hugging Face's) differ by about 1% of the
# largest logit, so a flip needs a gap of up to twice that.  A wrong cache or position
# (the bugs the check is for) gives gaps of the logits' own scale.
# Limits: tokens within the tolerance of a tie are not checked.
DECODE_TOLERANCE = 0.02


@torch.no_grad()
def decode_agreement(model, seqs: torch.Tensor, prompt: int, tolerance: float = DECODE_TOLERANCE) -> dict:
    """The cached decode's sequences ``seqs`` (batch, prompt + gen) teacher-forced through
    one uncached forward (Note [Cached decode against the uncached forward]): per generated
    position the gap between the uncached maximum logit and the cached token's, relative to
    the position's largest |logit| (at least 1)."""
    device = next(model.parameters()).device
    logits = model(input_ids=seqs[:, :-1].to(device)).logits[:, prompt - 1:].float().cpu()
    chosen = seqs[:, prompt:]
    top = logits.max(-1).values
    gap = (top - logits.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)) / logits.abs().amax(-1).clamp(min=1.0)
    return {"decode_positions": chosen.numel(),
            "decode_argmax_differ": int((logits.argmax(-1) != chosen).sum().item()),
            "decode_max_gap": gap.max().item(), "decode_tolerance": tolerance,
            "decode_within_tolerance": bool((gap <= tolerance).all().item())}


@torch.no_grad()
def conversion_check(model, gen: Generator, tokens: torch.Tensor, megatron_logits: torch.Tensor) -> dict:
    """How the converted model agrees with the trainer: Hugging Face's logits for the first
    rows of the prompts ``tokens`` at their last positions against Megatron's
    (``megatron_logits``, rows x positions x vocabulary; BF16 models: close, not equal), and
    the cached greedy decode against Hugging Face's uncached forward (equal sequences, and
    decode_agreement)."""
    rows, positions = megatron_logits.shape[:2]
    hf = model(input_ids=tokens[:rows].to(gen.device)).logits[:, -positions:].float().cpu()
    diff = (hf - megatron_logits).abs().max().item()
    prompts = tokens[:, :gen.prompt]
    cached = gen.generate(prompts)
    return {"max_abs_logit_diff": diff, "max_abs_logit": megatron_logits.abs().max().item(),
            "argmax_agree": (hf.argmax(-1) == megatron_logits.argmax(-1)).float().mean().item(),
            "cached_equals_uncached": bool(torch.equal(cached, gen.reference(prompts))),
            **decode_agreement(model, cached, gen.prompt)}

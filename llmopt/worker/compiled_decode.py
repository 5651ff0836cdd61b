"""The decode step without per-op overhead: every decoder layer in one C++ call.

A decode step of SmolLM2 in eager torch is about 40 small operations per layer, 1,200 a
step, each a trip through Python and the dispatcher: at batch 1 they, not the weights,
decide the step time, and the step reads its weights far below the machine's memory
bandwidth (benchmarks/results/roofline.md). Here the whole stack runs in one call into
llmopt/kernels/cpu/decode_step.cpp (RMSNorm, RoPE, the KV write, the paged attention
kernel, SiLU and the residuals fused into loops; the matmuls are torch's, or the GGUF block
kernels): a step is a handful of calls, as CUDA graphs make it on a GPU.

Why C++ and not torch.compile: Inductor's CPU code fuses the same elementwise work, but it
compiles per shape (every batch size and context bucket, each a long compile before the first
token), while this extension is built once per machine (cached on disk) and takes any shape.
`enforce_eager=True` (vLLM's meaning) keeps the plain path, the reference this one is tested
against: the same greedy tokens in float32.

It runs every step on the CPU (decodes; prompts and their chunks, where the same loops save the
eager path's elementwise passes over the prompt's rows, a 512-token prompt of SmolLM2's Q8_0 file
running faster here than eagerly; mixed steps; speculative verification steps, a sequence's
last token plus its k drafts, a chain or an EAGLE-2 tree under its tree mask: the step that must
cost about one decode step for speculation to pay), for Llama-family models whose linears are
dense or GGUF blocks and whose KV pool is in the model's dtype, bfloat16, int8 or int4; anything else (FP8 pools, other
quantized layers, draft trees too large for the kernels' masks, tensor or pipeline parallelism)
runs eagerly, and `why_not` says which. A draft model or an EAGLE head drafts through the same
call (`CompiledLayers`), so a speculative step has no eager stretch left.

Batch-invariant mode (`batch_invariant=True`: SGLang's enable_deterministic_inference, vLLM's
VLLM_BATCH_INVARIANT=1): a row's tokens must not depend on the rows beside it, so nothing may pick
its arithmetic by the step's size. Dense linears then take dense_matmul.cpp's row kernel at every
row count (each row of x is its own chain of sums over K, in the same order whatever M is; the bf16
panels and torch's GEMM, which block and split by M, are left out), GGUF linears their block kernels
at every row count (no dense copy above a limit), the head the same row kernel, and the attention
its invariant mode (fixed slices, one loop for every row: llmopt/kernels/cpu/paged_attention.cpp).
RMSNorm, RoPE, SiLU and the residuals are per row already. The cost is the speed those choices
give up (benchmarks/batch_invariance.py measures it).

The timings behind these choices: benchmarks/README.md, "Measurements behind the code's choices".
"""

from __future__ import annotations

import torch
from torch import nn

from llmopt.kernels import cpu
from llmopt.layers.attention import AttentionMetadata
from llmopt.kernels.cpu.kquant_blocks import KQuantWeight
from llmopt.layers.quant.gguf_linear import UNLIMITED, GGUFLinear
from llmopt.worker import huge_pages
from llmopt.worker.model_runner import StepBackend

LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

# How the step multiplies by a dense weight. bfloat16 on an AVX-512 CPU: the weights repacked
# once into panels of 32 rows (llmopt/kernels/cpu/dense_panels.cpp), at any number of rows: as fast
# as the row kernel below at one row of x, faster than it above, and faster than torch's bf16
# matmul at every size. The panels are a second copy of the weights: the originals serve the eager
# path (enforce_eager=True, a swapped-in model, draft trees too large for the kernels' masks).
# Without AVX-512, bfloat16 takes dense_matmul.cpp's row kernel at every number of rows: on AVX2
# alone torch's bf16 matmul has no native bf16 arithmetic and ran 4-5x slower than the row kernel at
# 1 to 512 rows. (With AMX tiles the row kernel wins up to 8 rows and torch's blocked GEMM from 16,
# kept as the limit there, though such CPUs have AVX-512 and so take the panels.) float32 stays on torch's matmul
# at every size: its one-row path already streams the weights near the bandwidth, and the same
# matmul as the eager path keeps the compiled step's float32 greedy tokens equal to eager's (the
# tests hold them so). (measured: benchmarks/README.md, "Measurements behind the code's choices")
def dense_kernel_max_rows(dtype: torch.dtype) -> int:
    if dtype != torch.bfloat16:
        return 0
    return 8 if "amx_bf16" in cpu.cpu_flags().split() else UNLIMITED


def dense_weight(weight: torch.Tensor, panels: bool = True) -> torch.Tensor:
    """What the step multiplies a dense linear by: bf16 panels where the kernel runs them (and
    `panels`), else W."""
    panels = cpu.dense_panels(weight) if panels and weight.dtype == torch.bfloat16 else None
    return weight.detach() if panels is None else panels


def why_not(model, kv_cache, device) -> str | None:
    """Why the compiled step cannot run this model on this pool (None when it can)."""
    return why_not_layers(model.model.layers, model.model.norm.weight.dtype, kv_cache, device)


def why_not_layers(layers, dtype, kv_cache, device) -> str | None:
    """Why these decoder layers cannot run compiled on this pool (None when they can)."""
    from llmopt.model.llama import LlamaDecoderLayer

    if torch.device(device).type != "cpu":
        return "the compiled decode step is for the CPU (CUDA would capture a graph)"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {dtype} (it runs float32 and bfloat16)"
    if getattr(kv_cache, "layout", None) != "paged" or kv_cache.cache_dtype not in (dtype, torch.bfloat16) and \
            getattr(kv_cache, "int_bits", None) is None:
        return ("the KV pool is not a paged pool in the model's dtype, bfloat16, int8 or int4 "
                "(FP8 pools decode eagerly)")
    if getattr(kv_cache, "rotation", None) is not None:
        return "the KV pool is rotated (PagedKVCache.rotate); the compiled step turns nothing"
    for layer in layers:
        if type(layer) is not LlamaDecoderLayer:
            return f"{type(layer).__name__} layers (it runs Llama-family decoders)"
        for name in LINEARS:
            lin = layer.self_attn.get_submodule(name) if name in ("qkv_proj", "o_proj") else layer.mlp.get_submodule(name)
            if type(lin) is nn.Linear:
                if lin.weight.dtype != dtype:
                    return f"{name} holds {lin.weight.dtype} weights in a {dtype} model"
            elif not isinstance(lin, GGUFLinear):
                return f"{type(lin).__name__} layers (it runs dense and GGUF-block linears)"
    if not cpu.available():
        return "the C++ CPU kernels could not be built here"
    return None


def why_not_invariant(model) -> str | None:
    """Why the compiled step cannot run this model batch-invariantly (None when it can): its head
    must be a dense bias-free linear, multiplied by the row kernel (a GGUF head hands large
    batches to a dense copy, a biased one to torch)."""
    head = model.lm_head
    if type(head) is not nn.Linear or head.bias is not None:
        return f"its head is {type(head).__name__}{' with a bias' if getattr(head, 'bias', None) is not None else ''}"
    return None


class CompiledLayers:
    """`run(h, meta)`: Llama decoder layers over a paged pool in one C++ call, h updated in
    place (before any final norm). The target's whole stack runs so (CompiledDecode below), and
    so does an EAGLE head's one layer (llmopt/spec/proposers.py). `batch_invariant`: each row's
    arithmetic independent of the step's other rows (the module's docstring)."""

    def __init__(self, layers, rotary, kv_cache, dtype: torch.dtype, max_step_rows: int = UNLIMITED,
                 batch_invariant: bool = False):
        self.kv_cache, self.rotary, self.dtype = kv_cache, rotary, dtype
        self.batch_invariant = batch_invariant
        attn = layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.eps = float(layers[0].input_layernorm.eps)
        self.no_tree = torch.empty(0, dtype=torch.int64)  # causal rows: no draft tree's mask
        # invariant: the row kernel at every row count (never torch's GEMM, never the panels)
        self.dense_rows = UNLIMITED if batch_invariant else dense_kernel_max_rows(dtype)
        ext = cpu.load()
        none = torch.empty(0, dtype=dtype)  # (what a layer does not have: bias, min, blocks)
        names = ("qkv", "o", "gate_up", "down")
        linears = [dict(zip(names, (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                                    layer.mlp.down_proj))) for layer in layers]
        # dense weights in the kernel's form; bf16 panels are this step's own copies: onto 2 MB pages
        # as the model's weights are (llmopt/worker/huge_pages.py), all in one mapping
        dense = {id(lin): dense_weight(lin.weight, panels=not batch_invariant) for ls in linears for lin in ls.values()
                 if not isinstance(lin, GGUFLinear)}
        own = [k for k, w in dense.items() if w.dim() == 5]
        dense.update(zip(own, huge_pages.onto_huge_pages([dense[k] for k in own])))

        def linear(lin):
            """One linear as the C++ step's named struct (llmopt/kernels/cpu/decode_step.h)."""
            bias = none if lin.bias is None else lin.bias.detach().to(dtype)
            if not isinstance(lin, GGUFLinear):
                return ext.Linear(kind=0, w=dense[id(lin)], qs=none, d=none, mn=none, bias=bias,
                                  int8=False, max_rows=UNLIMITED, dense_rows=self.dense_rows)
            b, max_rows = lin.weight_blocks, UNLIMITED if batch_invariant else lin.kernel_max_rows(dtype)
            # the dense copy is what batches above the kernel's limit multiply by, made only where a
            # step can bring that many rows (max_step_rows: the engine's token budget): a 1B model's
            # float copy is 5 GB, and with a budget of 32 tokens its prompts run on the blocks
            w = lin.dense_weight(dtype) if max_rows < max_step_rows else none
            max_rows = max_rows if max_rows < max_step_rows else UNLIMITED
            qs, d, mn = b.kernel_blocks(lin.activations)
            # k-quant super-blocks name their row ranges (one, or several of both types stacked)
            kinds, rows = b.kernel_parts() if isinstance(b, KQuantWeight) else ([], [])
            return ext.Linear(kind=b.ggml_type, w=w, qs=qs, d=d, mn=mn, bias=bias,
                              int8=lin.activations == "int8", max_rows=max_rows, dense_rows=self.dense_rows,
                              part_kinds=kinds, part_rows=rows)

        # the pool is in the model's dtype or int8 / int4 with its group scales (why_not refuses FP8
        # pools): unit per-layer scales
        no_scales = torch.empty(0, dtype=torch.uint8)
        self.layers = [ext.DecoderLayer(
            input_norm=layer.input_layernorm.weight.detach(),
            post_attention_norm=layer.post_attention_layernorm.weight.detach(),
            **{name: linear(lin) for name, lin in ls.items()},
            k_pool=kv_cache.k[i], v_pool=kv_cache.v[i], k_scale=1.0, v_scale=1.0,
            window=0 if layer.self_attn.window is None else int(layer.self_attn.window),
            k_scales=no_scales if kv_cache.k_scales is None else kv_cache.k_scales[i],
            v_scales=no_scales if kv_cache.v_scales is None else kv_cache.v_scales[i])
            for i, (layer, ls) in enumerate(zip(layers, linears))]

    def run(self, h: torch.Tensor, meta: AttentionMetadata) -> None:
        cos = self.rotary.cos[meta.positions].to(self.dtype).contiguous()
        ssin = self.rotary.signed_sin[meta.positions].to(self.dtype).contiguous()
        tree = self.no_tree if meta.tree_bits is None else meta.tree_bits
        cpu.load().decode_layers(
            h, cos, ssin, self.layers, meta.slot_mapping.long(), meta.block_table_tensor, meta.query_start_loc,
            meta.seq_lens_tensor, tree, self.num_heads, self.num_kv_heads, self.head_dim, self.eps,
            self.batch_invariant)


class CompiledDecode(StepBackend):
    """The CPU's step backend (llmopt/worker/model_runner.py): `forward(input_ids, meta)` = the
    model's hidden states for a step, every decoder layer in one C++ call (`batch_invariant`: each
    row's arithmetic independent of the step's other rows, the head's included)."""

    path = "compiled"

    def __init__(self, model, kv_cache, max_step_rows: int = UNLIMITED, batch_invariant: bool = False):
        self.model, self.kv_cache = model, kv_cache
        stack = model.model
        self.dtype = stack.norm.weight.dtype  # (the embedding may be GGUF blocks)
        self.layers = CompiledLayers(stack.layers, stack.rotary_emb, kv_cache, self.dtype, max_step_rows,
                                     batch_invariant)
        self.dense_rows, self.batch_invariant = self.layers.dense_rows, batch_invariant
        head = model.lm_head
        self.head = (dense_weight(head.weight, panels=not batch_invariant)
                     if type(head) is nn.Linear and head.bias is None else None)
        if self.head is not None and self.head.dim() == 5:
            self.head = huge_pages.onto_huge_pages([self.head])[0]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # step choice: backend (a draft tree too large for the kernels' masks runs eagerly)
        if meta.tree_masks is not None and meta.tree_bits is None:
            return super().forward(input_ids, meta)
        stack = self.model.model
        h = stack.embed_tokens(input_ids).contiguous()  # a fresh tensor: the C++ step updates it in place
        self.layers.run(h, meta)
        return stack.norm(h)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's `compute_logits`, its dense head through the same kernel at a few rows:
        SmolLM2's tied head is 49,152 x 576, the largest single weight a step reads."""
        if self.head is not None and (self.head.dim() == 5 or hidden.shape[0] <= self.dense_rows):
            return cpu.load().dense_matmul(hidden.contiguous(), self.head).float()
        return super().compute_logits(hidden)

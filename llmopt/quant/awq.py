"""AWQ (Lin et al., 2023): protect the weights that meet large activations, by scaling.

A few input channels carry much larger activations than the rest; the weights they meet
matter most, and plain rounding treats them like any other. AWQ multiplies those weight
columns by a per-channel factor s > 1 before quantizing (so they use more of the grid and
their relative rounding error shrinks) and divides the activations by s, which costs
nothing when the division is folded into the operation that produces them:

    y = W x = (W diag(s)) (diag(s)^-1 x)        Q(W diag(s)) is what gets stored

- s = mean|x|^alpha per input channel (the paper's rule), or with duo_scaling (AutoAWQ's
  default, and llmopt's) mean|x|^alpha / w_mean^(1 - alpha), where w_mean is each input
  channel's mean |w| relative to its group's max; normalized, with alpha picked from a grid
  of 20 by the block's output error (MSE) on calibration inputs;
- the division goes into the preceding RMSNorm weight (for q/k/v and gate/up), or into
  the preceding linear's output rows (up -> down, and v -> o when their shapes match; with
  grouped-query attention v has fewer rows than o has inputs, so that pair is skipped);
- then a clipping search: per output row and group, shrink the clamp range max|w| by up
  to half if that lowers the layer's output error (not for q and k, whose errors the
  attention softmax amplifies).
The final weights are rounded to the nearest grid point (RTN with zero point). The next
block's inputs are the full-precision block's outputs, as in AutoAWQ.
"""

from __future__ import annotations

import torch

from llmopt.quant.rtn import fake_quantize

N_GRID = 20


def activation_scale(x: torch.Tensor) -> torch.Tensor:
    """mean |x| per input channel over every calibration token."""
    return x.abs().reshape(-1, x.shape[-1]).float().mean(0)


@torch.no_grad()
def weight_scale(weights: list[torch.Tensor], group_size: int) -> torch.Tensor:
    """mean over output rows of |w| / (its group's max |w|), per input channel (AutoAWQ's w_mean)."""
    w = torch.cat(weights).float().abs()
    g = w.shape[1] if group_size == -1 else group_size
    groups = w.reshape(-1, g)
    return (groups / (groups.amax(1, keepdim=True) + 1e-6)).reshape(w.shape).mean(0)


@torch.no_grad()
def search_scale(block, x: torch.Tensor, linears: list, qcfg: dict, n_grid: int = N_GRID,
                 search_tokens: int | None = None, duo_scaling: bool = False,
                 x_mean: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """The per-input-channel scale s for `linears` (which all read x), chosen by the output
    error of `block` (a callable of x that runs through them) with their weights fake-quantized,
    measured on the first `search_tokens` tokens (mean |x| uses them all). With duo_scaling
    (AutoAWQ's default), s = mean|x|^alpha / w_mean^(1 - alpha) weighs the weights in as well.
    `x_mean`: activation_scale(x), when the caller has it already.
    Returns s, the error for each alpha tried, and the error without scaling (plain RTN)."""
    x_mean = activation_scale(x) if x_mean is None else x_mean
    w_mean = weight_scale([lin.weight.data for lin in linears], qcfg["group_size"]) if duo_scaling else None
    x = x[:search_tokens]
    reference = block(x)
    originals = [lin.weight.data.clone() for lin in linears]
    best, best_err, errors = None, float("inf"), {}
    for i in range(n_grid):
        alpha = i / n_grid
        if duo_scaling:
            s = (x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
        else:
            s = x_mean.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()           # centre the scales around 1
        for lin, w in zip(linears, originals):
            lin.weight.data = (fake_quantize(w * s, **qcfg) / s).to(w.dtype)
        err = (block(x) - reference).float().pow(2).mean().item()
        errors[alpha] = err
        if err < best_err:
            best, best_err = s.clone(), err
    for lin, w in zip(linears, originals):
        lin.weight.data = (fake_quantize(w, **qcfg)).to(w.dtype)
    rtn_error = (block(x) - reference).float().pow(2).mean().item()
    for lin, w in zip(linears, originals):
        lin.weight.data = w
    return best, errors, rtn_error


@torch.no_grad()
def search_clip(weight: torch.Tensor, x: torch.Tensor, qcfg: dict, group_size: int,
                n_grid: int = N_GRID, max_shrink: float = 0.5, n_tokens: int = 512,
                row_batch: int = 64) -> torch.Tensor:
    """Per output row and group, the clamp value max|w| * (1 - i / n_grid), i < max_shrink * n_grid,
    whose fake-quantized group output (on a sample of tokens) is closest to the original's.
    Returns max_val [out, groups]."""
    n_out, k = weight.shape
    g = k if group_size == -1 else group_size
    x = x.reshape(-1, k)
    x = x[:: max(1, x.shape[0] // n_tokens)].float().reshape(-1, k // g, g)   # [t, groups, g]
    best_all = []
    for r in range(0, n_out, row_batch):
        w = weight[r:r + row_batch].float().reshape(-1, k // g, g)            # [rows, groups, g]
        original_max = w.abs().amax(-1)                                        # [rows, groups]
        reference = torch.einsum("tgj,rgj->rtg", x, w)
        best, best_err = original_max.clone(), torch.full_like(original_max, float("inf"))
        for i in range(int(max_shrink * n_grid)):
            max_val = original_max * (1 - i / n_grid)
            clipped = torch.maximum(torch.minimum(w, max_val[..., None]), -max_val[..., None])
            q = fake_quantize(clipped.reshape(-1, k), **qcfg).reshape(w.shape)
            err = (torch.einsum("tgj,rgj->rtg", x, q) - reference).pow(2).mean(1)   # [rows, groups]
            better = err < best_err
            best_err[better], best[better] = err[better], max_val[better]
        best_all.append(best)
    return torch.cat(best_all)


def apply_clip(weight: torch.Tensor, max_val: torch.Tensor) -> torch.Tensor:
    n_out, k = weight.shape
    w = weight.reshape(n_out, max_val.shape[1], -1)
    return torch.maximum(torch.minimum(w, max_val[..., None]), -max_val[..., None]).reshape(n_out, k)


@torch.no_grad()
def awq_scale(layer, inputs: dict[str, torch.Tensor], attention, qcfg: dict, num_heads: int,
              num_kv_heads: int, q_size: int, kv_size: int, search_tokens: int | None = None,
              duo_scaling: bool = False) -> dict:
    """Search and fold one decoder layer's scales, in place. `inputs` holds each linear's
    calibration input (divided by its scales on the way out, for the clipping search);
    `attention` runs the attention block on normed inputs of whole windows; the alpha grid
    is scored on the first `search_tokens` tokens. The layer computes the same function
    afterwards (up to rounding): only where the factors sit has changed.
    Returns the scales, the block error of every alpha tried and of plain RTN, and each input's
    mean |x|, for the lesson's plots."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv, o, gate_up, down = attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
    chosen, rtn, kw = {}, {}, dict(search_tokens=search_tokens, duo_scaling=duo_scaling)
    x_mean = {name: activation_scale(x) for name, x in inputs.items()}

    def search(name, block, linear):
        s, chosen[name], rtn[name] = search_scale(block, inputs[name], [linear], qcfg, x_mean=x_mean[name], **kw)
        return s

    # all searched on the original weights, then applied
    s_qkv = search("qkv_proj", attention, qkv)
    s_mlp = search("gate_up_proj", mlp, gate_up)
    s_down = search("down_proj", down, down)
    s_o = None
    if num_heads == num_kv_heads:  # v's output rows line up with o's inputs only without GQA
        s_o = search("o_proj", o, o)

    def fold(prev_rows: torch.Tensor, s: torch.Tensor, linear, name: str, bias=None):
        prev_rows.div_(s.view(-1, *[1] * (prev_rows.dim() - 1)).to(prev_rows.dtype))
        if bias is not None:
            bias.div_(s.to(bias.dtype))
        linear.weight.data.mul_(s.to(linear.weight.dtype))
        inputs[name] = inputs[name] / s                   # the clip search sees scaled inputs

    fold(layer.input_layernorm.weight.data, s_qkv, qkv, "qkv_proj")
    fold(layer.post_attention_layernorm.weight.data, s_mlp, gate_up, "gate_up_proj")
    up_rows = gate_up.weight.data[-s_down.numel():]       # gate_up = [gate; up]: up is the tail
    up_bias = gate_up.bias.data[-s_down.numel():] if gate_up.bias is not None else None
    fold(up_rows, s_down, down, "down_proj", up_bias)
    if s_o is not None:
        v_rows = qkv.weight.data[q_size + kv_size:]       # qkv = [q; k; v]: v is the tail
        v_bias = qkv.bias.data[q_size + kv_size:] if qkv.bias is not None else None
        fold(v_rows, s_o, o, "o_proj", v_bias)
    return {"scales": {"qkv_proj": s_qkv, "gate_up_proj": s_mlp, "down_proj": s_down, "o_proj": s_o},
            "errors": chosen, "rtn_error": rtn, "x_mean": x_mean}


@torch.no_grad()
def awq_clip(layer, inputs: dict[str, torch.Tensor], qcfg: dict, q_size: int, kv_size: int) -> None:
    """The clipping search on every linear of the layer, in place (q and k rows keep their range)."""
    qkv = layer.self_attn.qkv_proj
    v = qkv.weight.data[q_size + kv_size:]
    v.copy_(apply_clip(v, search_clip(v, inputs["qkv_proj"], qcfg, qcfg["group_size"])))
    for name, lin in (("o_proj", layer.self_attn.o_proj), ("gate_up_proj", layer.mlp.gate_up_proj),
                      ("down_proj", layer.mlp.down_proj)):
        lin.weight.data = apply_clip(lin.weight.data, search_clip(lin.weight.data, inputs[name], qcfg,
                                                                  qcfg["group_size"]))

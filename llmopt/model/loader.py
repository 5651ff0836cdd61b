"""Load a Hugging Face safetensors checkpoint into llmopt's decoder.

Every failure is a `ValueError` that names the file or tensor at fault, raised before
any weights are used: a missing config.json or weights file, a corrupt safetensors
header, an architecture we do not implement, a missing or misshapen tensor.

Quantized checkpoints (config.json's `quantization_config`: GPTQ, AWQ, FP8) get the
matching modules of `llmopt.layers.quant` (registry.py builds them) in place of the decoder's `nn.Linear` layers
before any memory is allocated; `quantization="int8" | "fp8"` quantizes a full-precision
checkpoint's linear layers right after loading it.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
# Imported now, not lazily: the first nn.init call under a device context imports it, and
# torch.fx.wrap keeps the importing frame (and every frame above it: the LLM's __init__ with
# `self`) in a reference cycle, so the first LLM of a process outlived `del` until gc ran.
import torch._dynamo  # noqa: F401
from safetensors import safe_open

from llmopt.model.build import meta_model, tie_and_rotate, trim_heap
from llmopt.model.config import ModelConfig
from llmopt.model.gguf import forget_gguf_readers, is_gguf, iter_gguf, load_gguf_tokenizer, tensor_elements
from llmopt.model.llama import LlamaForCausalLM
from llmopt.model.registry import tokenizer_folder


def index_shards(index: Path) -> list[str]:
    """The shard file names a model.safetensors.index.json's weight_map lists. An index that was a list,
    a weight_map that was not an object or a shard that was a number raised TypeError / AttributeError;
    a shard named "/etc/passwd" or "../x" was read from outside the checkpoint folder."""
    try:
        data = json.loads(index.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{index} is corrupt ({e})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index} is corrupt: it must be a JSON object whose \"weight_map\" maps each "
                         "tensor name to the .safetensors file beside it that holds the tensor")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or Path(shard).name != shard or not shard.endswith(".safetensors"):
            raise ValueError(f"{index}: weight_map[{name!r}] is {shard!r}; it must be the name of a "
                             f".safetensors file in {index.parent}")
    return sorted(set(weight_map.values()))


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = [folder / s for s in index_shards(index)]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        other = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
        hint = (f" (found {', '.join(other)}: convert them to safetensors)" if other else
                "; a config.json alone is a model's shape: load_format='dummy' builds it with random "
                "weights (speed only)")
        raise ValueError(f"checkpoint folder {folder} has no model.safetensors{hint}")
    for f in files:
        if not f.is_file():
            raise ValueError(f"checkpoint shard {f} is listed in the index but missing")
    return files


def iter_checkpoint(files: list[Path]):
    for f in files:
        try:
            handle = safe_open(str(f), framework="pt")
        except Exception as e:
            raise ValueError(f"checkpoint file {f} is corrupt or not safetensors ({e})") from None
        with handle:
            for name in handle.keys():
                try:
                    yield name, handle.get_tensor(name)
                except Exception as e:
                    raise ValueError(f"checkpoint file {f}: tensor {name!r} is unreadable ({e})") from None


def stored_elements(files: list[Path]) -> dict[str, int]:
    """Each tensor's element count, from the safetensors headers alone (no tensor is read)."""
    counts, held_in = {}, {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                names = list(handle.keys())
                for name in names:
                    counts[name] = math.prod(handle.get_slice(name).get_shape())
        except Exception as e:
            raise ValueError(f"checkpoint file {f} is corrupt or not safetensors ({e})") from None
        for name in names:  # two shards with one tensor: the last one read won, silently
            if name in held_in:
                raise ValueError(f"tensor {name!r} is stored twice, in {held_in[name]} and in {f}; "
                                 "each tensor must be in exactly one checkpoint file")
            held_in[name] = f
    return counts


def check_layer_count(cfg: ModelConfig, stored: dict[str, int], source: str) -> None:
    """config.json's num_hidden_layers against the layers the checkpoint holds, before the model is
    built: num_hidden_layers=10**9 built modules until memory ran out (a MemoryError, or a hang)."""
    found = {int(m.group(1)) for name in stored if (m := re.match(r"(?:model\.layers|blk)\.(\d+)\.", name))}
    held = max(found) + 1 if found else 0
    if cfg.num_hidden_layers > held:
        raise ValueError(f"{source}: config says num_hidden_layers={cfg.num_hidden_layers}, but the checkpoint "
                         f"holds the tensors of {held} layers; num_hidden_layers must be at most {held}")


def check_weight_count(model, stored: dict[str, int], source: str) -> None:
    """The model's parameters (on meta: counted, not allocated) against the checkpoint's, before any
    memory is allocated: hidden_size=10**9 asked torch for 16 TB. A checkpoint holds at least as many
    values as the model it loads into; the slack allows tied heads and 4-bit packing."""
    tied = model.config.tie_word_embeddings
    implied = sum(p.numel() for n, p in model.named_parameters() if not (tied and n == "lm_head.weight"))
    held = sum(stored.values())
    if implied > 4 * held + (1 << 20):
        c = model.config
        raise ValueError(f"{source}: config implies {implied:,} weights but the checkpoint holds {held:,}; "
                         f"its sizes (vocab_size {c.vocab_size}, hidden_size {c.hidden_size}, intermediate_size "
                         f"{c.intermediate_size}, num_hidden_layers {c.num_hidden_layers}) must match the weights")


def load_model(folder: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               quantization: str | None = None, load_format: str = "auto", seed: int = 0) -> LlamaForCausalLM:
    """A Hugging Face folder (safetensors) or a GGUF file -> the decoder, weights loaded; with
    load_format="dummy", the decoder its config describes with random weights (llmopt.model.dummy)."""
    folder = Path(folder)
    cfg = ModelConfig.from_pretrained(folder)
    if load_format == "dummy":
        from llmopt.model.dummy import dummy_model

        model = dummy_model(cfg, folder, dtype, torch.device(device), seed)
        if quantization is not None:
            quantize_linears(model, quantization)
            trim_heap()
        return model
    if quantization == "gguf":
        if not is_gguf(folder):
            raise ValueError(f"quantization='gguf' keeps a GGUF file's quantized blocks; {folder} is not a .gguf file")
        return _gguf_blocks_model(cfg, folder, dtype, device)
    scheme = None
    if cfg.quantization_config is not None or quantization is not None:
        scheme = quant_scheme(cfg, quantization, folder)
    if is_gguf(folder):  # dequantized on the way in; read before any memory is allocated
        weights = iter_gguf(folder)
        stored = tensor_elements(folder)
    else:
        files = safetensors_files(folder)
        weights, stored = iter_checkpoint(files), stored_elements(files)
    check_layer_count(cfg, stored, str(folder))
    model = meta_model(cfg)  # shapes only, then allocated for real below
    if scheme is not None and scheme.serialized:
        # swap the quantized modules in while still on meta, after the dtype cast, so their
        # int32 / fp16 / fp8 tensors keep the dtypes the checkpoint stores
        model = model.to(dtype)
        use_quantized_linears(model, scheme, dtype)
    check_weight_count(model, stored, str(folder))
    if scheme is None or not scheme.serialized:
        model = model.to(dtype)  # still on meta: the weights are allocated once, in their own dtype
    model = model.to_empty(device=device)
    tie_and_rotate(model, cfg, device)
    load_weights(model, weights, source=str(folder))
    if is_gguf(folder):
        # The parsed header (a 49K-token vocabulary as ~10^5 small arrays) and the file's map
        # (every page of it read once): ~250 MB for SmolLM2 that nothing needs once the weights are
        # in. A later load parses the header again (a few seconds).
        forget_gguf_readers()
    trim_heap()  # before quantizing, which holds both precisions of a layer at once
    if scheme is not None and not scheme.serialized:
        quantize_linears(model, scheme.method)
    trim_heap()
    return model.eval()


def _gguf_blocks_model(cfg: ModelConfig, path: Path, dtype: torch.dtype, device) -> LlamaForCausalLM:
    """A GGUF file's quantized tensors kept as its blocks (llmopt.model.gguf_repack), swapped in
    while the model is still on meta, so that only the rest (norms, tensors of types no kernel
    runs) is allocated and dequantized: a 1B Q8_0 file loads in its own 1.3 GB, not 5 GB of floats."""
    from llmopt.model.gguf_repack import repack_gguf_linears

    check_layer_count(cfg, tensor_elements(path), str(path))
    forget_gguf_readers()  # the parsed header (a vocabulary's strings) goes before the blocks come in
    model, kept = meta_model(cfg, dtype), set()
    repack_gguf_linears(model, str(path), consumed=kept)
    model = model.to_empty(device=device)
    tie_and_rotate(model, cfg, device)
    load_weights(model, iter_gguf(path, skip=kept), source=str(path))
    forget_gguf_readers()
    trim_heap()
    return model.eval()


def load_tokenizer(path: str | Path):
    """The tokenizer of a Hugging Face folder, or the one a GGUF file's metadata describes."""
    from transformers import AutoTokenizer

    if is_gguf(path):
        return load_gguf_tokenizer(path)
    path = tokenizer_folder(path)
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        raise ValueError(f"could not load a tokenizer from {path} ({type(e).__name__}: {e}); the "
                         "folder needs tokenizer.json and tokenizer_config.json") from None


# -- quantized checkpoints -----------------------------------------------------------------------------
def quant_scheme(cfg: ModelConfig, quantization: str | None, folder: Path):
    """What config.json's quantization_config (or the `quantization` argument) asks for."""
    from llmopt.layers.quant.formats import QuantScheme  # the plain path imports no quantization code

    if cfg.quantization_config is None:
        return QuantScheme.on_load(quantization)
    scheme = QuantScheme.from_config(cfg.quantization_config, f"{folder}/config.json")
    if quantization is not None and quantization != scheme.method:
        raise ValueError(f"quantization={quantization!r}, but {folder} is a {scheme.method!r} checkpoint; "
                         f"pass quantization=None (or {scheme.method!r}) to load it as it is")
    return scheme


def use_quantized_linears(model: LlamaForCausalLM, scheme, dtype: torch.dtype) -> None:
    """Replace (on meta) each linear layer the scheme converts by an empty quantized one."""
    from llmopt.layers.quant.registry import make_quant_linear

    for name, parts in model.quantizable_linears().items():
        if scheme.converts(parts):
            dense = model.get_submodule(name)
            with torch.device("meta"):
                if scheme.method == "nf4":
                    from llmopt.layers.quant.nf4 import NF4Linear

                    q = NF4Linear(dense.in_features, dense.out_features, scheme.group_size,
                                  dense.bias is not None, dtype)
                else:
                    q = make_quant_linear(scheme, dense.in_features, dense.out_features,
                                          dense.bias is not None, dtype)
            model.set_submodule(name, q)


@torch.no_grad()
def quantize_linears(model: LlamaForCausalLM, method: str) -> None:
    """Quantize-on-load: "int8" (RTN, per output channel) or "fp8" (e4m3, per output channel)."""
    from llmopt.fp8.linear import Fp8Linear
    from llmopt.layers.quant.int8 import Int8Linear

    make = {"int8": Int8Linear, "fp8": Fp8Linear}[method].from_linear
    for name in model.quantizable_linears():
        model.set_submodule(name, make(model.get_submodule(name)))
        trim_heap()  # the float layer just replaced: its pages back before the next one is made


DENSE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def all_finite(t: torch.Tensor) -> bool:
    # torch has no isfinite for float8_e4m3fn (which has NaN but no inf)
    return not bool(torch.isnan(t).any()) if t.element_size() == 1 else bool(torch.isfinite(t).all())


def check_quant_tensor(module, leaf: str, tensor: torch.Tensor, what: str) -> None:
    """A quantized layer's float tensors (scales, fp8 weights, bias), before they are placed: NaN / inf
    scales or fp8 weights and int scales (cast as they were) loaded and generated token 0 forever; a
    negative FP8 scale flipped its rows' signs. The layer itself checks its packed integer tensors."""
    dest = getattr(module, leaf, None)
    if isinstance(dest, torch.Tensor) and dest.is_floating_point() and not tensor.is_floating_point():
        raise ValueError(f"{what} is {tensor.dtype}; {leaf} must be a float tensor (llmopt keeps it in {dest.dtype})")
    if tensor.is_floating_point() and not all_finite(tensor):
        raise ValueError(f"{what} holds NaN or infinite values; every scale and weight must be a finite number")
    if leaf in ("weight_scale", "input_scale") and bool((tensor.float() < 0).any()):
        raise ValueError(f"{what} holds negative values; an FP8 scale (max |w| / 448) must be >= 0")


def load_weights(model: LlamaForCausalLM, weights, source: str = "checkpoint") -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name:
            continue  # recomputed from the config
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # tied: the embedding is the head
        target, rows, index = name, None, None
        if hasattr(model, "checkpoint_target"):  # a model with its own layout (DeepSeek's experts)
            target, index = model.checkpoint_target(name)
        else:
            for fused, part, shard in model.stacked_params:
                if f".{part}." in name:
                    target = name.replace(part, fused)
                    rows = model.shard_rows(fused, shard)
                    index = slice(*rows)
                    break
        # bitsandbytes stores a 4-bit weight's quantization state beside it: weight.absmax, ...
        module_name, bnb_state, rest = target.partition(".weight.")
        leaf = "weight." + rest if bnb_state else None
        if target not in params and not (bnb_state and module_name + ".weight" in params):
            continue  # tensors of heads we do not run (e.g. a value head) are ignored
        if leaf is None:
            module_name, _, leaf = target.rpartition(".")
        module = model.get_submodule(module_name)
        if bnb_state and not hasattr(module, "load_checkpoint_tensor"):
            raise ValueError(f"{source}: tensor {name!r} is bitsandbytes quantization state for a layer "
                             "the checkpoint's quantization_config keeps dense")
        if hasattr(module, "load_checkpoint_tensor"):  # a quantized linear places its packed shards
            check_quant_tensor(module, leaf, tensor, f"{source}: tensor {name!r}")
            module.load_checkpoint_tensor(leaf, tensor, rows, f"{source}: tensor {name!r}")
            loaded.add(name)
            continue
        param = params[target]
        dest = param.data if index is None else param.data[index]
        if dest.shape != tensor.shape:
            raise ValueError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"config.json implies {tuple(dest.shape)}")
        # int8 / bool / fp8 values were cast to the model's dtype as they were (a quantized checkpoint
        # without its quantization_config loaded as garbage); complex ones lost their imaginary part
        if dest.is_floating_point() and tensor.dtype not in DENSE_DTYPES:
            raise ValueError(f"{source}: tensor {name!r} is {tensor.dtype}; a dense weight must be float16, "
                             "bfloat16, float32 or float64 (a quantized checkpoint names its scheme in "
                             "config.json's quantization_config)")
        dest.copy_(tensor.to(dest.dtype))
        # NaN / inf weights loaded, and every step then sampled garbage (a NaN norm: token 4095 forever).
        # Checked after the cast: a bfloat16 weight past 65504 is inf in float16.
        if dest.is_floating_point() and not all_finite(dest):
            raise ValueError(f"{source}: tensor {name!r} holds NaN or infinite values"
                             + (f" once cast to {dest.dtype}" if torch.isfinite(tensor).all() else "")
                             + "; every weight must be a finite number")
        loaded.add(name)
    expected = set()
    for pname in params:
        if pname == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        module_name, _, leaf = pname.rpartition(".")
        if leaf in getattr(model.get_submodule(module_name), "OPTIONAL", ()):
            continue
        if hasattr(model, "checkpoint_names"):
            parts = model.checkpoint_names(pname)
        else:
            parts = [pname.replace(fused, part) for fused, part, _ in model.stacked_params
                     if f".{fused}." in pname]
        expected.update(parts or [pname])
    missing = sorted(expected - loaded)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"{source}: checkpoint lacks {', '.join(missing[:5])}{more}")
    for module in model.modules():
        if hasattr(module, "after_loading"):
            module.after_loading(source)


def generation_eos_ids(path: Path) -> set[int]:
    """The end-of-sequence ids a checkpoint's generation_config.json adds to config.json's."""
    f = Path(path) / "generation_config.json"  # (a GGUF file has none: its header names EOS)
    if not f.is_file():
        return set()
    try:
        eos = json.loads(f.read_text()).get("eos_token_id")
    except json.JSONDecodeError as e:
        raise ValueError(f"{f} is not valid JSON: {e}") from None
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {int(eos)}

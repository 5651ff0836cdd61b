"""GGUF loading: the bundled `tiny` written out as a llama.cpp-style GGUF (Q and K rows permuted
as llama.cpp's converter permutes them) loads back to exactly the same logits; bad files get
a clear error naming what is wrong."""

import numpy as np
import pytest
import torch
from gguf import GGUFWriter

from llmopt import LLM, model_path
from llmopt.layers.attention import AttentionMetadata
from llmopt.model.config import ModelConfig
from llmopt.model.forward import run_model
from llmopt.model.gguf import unpermute_rope_rows
from llmopt.model.loader import iter_checkpoint, load_model, safetensors_files
from llmopt.worker.kv_cache import NoKVCache


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q_proj / k_proj rows."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


GGUF_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def write_gguf(path, arch="llama", drop=(), truncate_to=None, shrink=(), **meta):
    folder = model_path("tiny")
    cfg = ModelConfig.from_pretrained(folder)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads  # the weights' own, for the permutation
    for key, value in meta.items():  # a header size changed: num_attention_heads=0, ...
        setattr(cfg, key, value)
    w = GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    for name, t in iter_checkpoint(safetensors_files(folder)):
        a = t.float().numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            module, leaf = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{GGUF_NAMES[module]}.{leaf}"
            if module == "self_attn.q_proj":
                a = llama_cpp_permute(a, heads)
            elif module == "self_attn.k_proj":
                a = llama_cpp_permute(a, kv_heads)
        if gname in shrink:
            a = a[:-64]
        if gname not in drop:
            w.add_tensor(gname, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if truncate_to is not None:
        data = path.read_bytes()
        path.write_bytes(data[:int(len(data) * truncate_to)])
    return path


def test_unpermute_inverts_llama_cpp():
    w = torch.randn(3 * 64, 40)
    permuted = torch.from_numpy(llama_cpp_permute(w.numpy(), 3))
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_rope_rows(permuted, 3), w)


@torch.inference_mode()
def test_tiny_as_gguf_gives_the_same_logits(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf")
    ours, ref = load_model(path), load_model(model_path("tiny"))
    assert ModelConfig.from_pretrained(path).tie_word_embeddings == ref.config.tie_word_embeddings
    ids = torch.tensor([1, 319, 260, 1200, 77, 5, 9, 4000])
    out = []
    for m in (ours, ref):
        out.append(m.compute_logits(run_model(m, NoKVCache(), ids, AttentionMetadata.uncached([len(ids)]))))
    assert torch.equal(out[0], out[1])


@pytest.mark.parametrize("kind, match", [
    ("other-arch", "architecture 'qwen2' is not supported"),
    ("missing", "lacks the tensor blk.1.attn_k.weight"),
    ("truncated", "truncated or corrupt"),
    ("not-gguf", "is not a GGUF file"),
])
def test_bad_gguf_files_are_refused_clearly(tmp_path, kind, match):
    path = tmp_path / f"{kind}.gguf"
    if kind == "other-arch":
        write_gguf(path, arch="qwen2")
    elif kind == "missing":
        write_gguf(path, drop=("blk.1.attn_k.weight",))
    elif kind == "truncated":
        write_gguf(path, truncate_to=0.5)
    else:
        path.write_bytes(b"PK\x03\x04 this is a zip file")
    with pytest.raises(ValueError, match=match) as e:
        load_model(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_attention_heads=0), "llama.attention.head_count must be >= 1"),   # ZeroDivisionError
    (dict(num_hidden_layers=0), "num_hidden_layers must be an integer in 1..4096"),   # loaded with no layers
    (dict(num_hidden_layers=100), "num_hidden_layers=100.*6 layers"),
    (dict(hidden_size=10**9), "config implies .* weights but the checkpoint holds"),   # asked for 16 EB
    (dict(shrink=("blk.0.attn_q.weight",)), r"'blk.0.attn_q.weight' has shape \(320, 384\).*imply \(384, 384\)"),
])
def test_gguf_header_sizes_that_do_not_fit_are_named(tmp_path, kwargs, match):
    path = write_gguf(tmp_path / "bad.gguf", **kwargs)  # the Q row error was a bare torch reshape error
    with pytest.raises(ValueError, match=match) as e:
        load_model(path)
    assert str(path) in str(e.value)


def test_model_argument_accepts_gguf_paths(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(model=str(tmp_path / "nowhere.gguf"))
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match="not a .gguf"):
        LLM(model=str(tmp_path / "weights.bin"))
    write_gguf(tmp_path / "a.gguf")
    write_gguf(tmp_path / "b.gguf")
    with pytest.raises(ValueError, match="several GGUF files"):
        LLM(model=str(tmp_path))

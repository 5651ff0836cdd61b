"""llmopt's decoder equals Hugging Face transformers on the same weights.

Logits within 1e-4 (float32), and greedy generation token-identical to
`transformers.generate`, for the bundled models and random-weight Llama (llama3 RoPE,
biases), tied-embedding MQA Llama (linear RoPE), Qwen2 and Mistral (sliding window).
"""

import pytest
import torch
from checkpoints import assert_flat_logits_match, hf_model

from llmopt import LLM, SamplingParams, model_path
from llmopt.layers.attention import AttentionMetadata
from llmopt.model.forward import run_model
from llmopt.model.loader import load_model
from llmopt.worker.kv_cache import ContiguousKVCache

RANDOM = ["llama3", "llama-tied", "qwen2", "mistral"]
ALL = ["tiny", "tiny-draft"] + RANDOM


def folder_of(name, checkpoint_dir):
    return model_path(name) if name in ("tiny", "tiny-draft") else checkpoint_dir(name)


@pytest.mark.parametrize("name", ALL)
@torch.inference_mode()
def test_logits_match_transformers(name, checkpoint_dir):
    folder = folder_of(name, checkpoint_dir)
    ours, ref = load_model(folder), hf_model(folder)
    # naive path: the three sequences flattened into one varlen batch
    seqs, expected = assert_flat_logits_match(ours, ref, [5, 17, 60])

    # cached path: prefill a prefix, then decode the rest one token at a time
    cfg = ours.config
    kv = ContiguousKVCache(cfg.num_hidden_layers, 1, 64, cfg.num_key_value_heads, cfg.head_dim)
    slot, s, split = kv.allocate(), seqs[2], 40
    parts = [ours.compute_logits(run_model(ours, kv, s[:split], AttentionMetadata.contiguous([slot], [0], [split])))]
    for i in range(split, len(s)):
        meta = AttentionMetadata.contiguous([slot], [i], [1])
        parts.append(ours.compute_logits(run_model(ours, kv, s[i:i + 1], meta)))
    assert (torch.cat(parts) - expected[2]).abs().max().item() <= 1e-4


def hf_greedy(model, prompts: list[list[int]], n: int, pad_id: int, stop_at_eos: bool):
    """transformers' greedy generate on a left-padded batch; returns new tokens per prompt."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = {} if stop_at_eos else {"eos_token_id": None}
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                         pad_token_id=pad_id, **kwargs)[:, width:].tolist()
    eos = model.generation_config.eos_token_id
    if stop_at_eos:  # trim what transformers pads after EOS
        out = [row[:row.index(eos) + 1] if eos in row else row for row in out]
    return out


@pytest.mark.parametrize("name", ALL)
def test_greedy_generation_matches_transformers(name, checkpoint_dir):
    folder = folder_of(name, checkpoint_dir)
    real = name in ("tiny", "tiny-draft")
    llm = LLM(model=str(folder))
    ref = hf_model(folder)
    if real:
        texts = ["def fibonacci(n):", "class Stack:\n    def push(self, x):", "import os\n"]
        prompts = [llm.tokenizer(t)["input_ids"] for t in texts]
    else:
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, 4096, (n,), generator=g).tolist() for n in (3, 11, 29)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=not real)

    # one prompt alone, then all of them as one batch of different lengths
    alone = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    with torch.inference_mode():
        hf_alone = hf_greedy(ref, prompts[:1], 64, pad_id=2, stop_at_eos=real)
        hf_batch = hf_greedy(ref, prompts, 64, pad_id=2, stop_at_eos=real)
    assert alone[0].outputs[0].token_ids == hf_alone[0]
    batch = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batch] == hf_batch


def test_min_tokens_holds_stop_tokens_back_as_transformers_does(tiny_llm):
    """min_tokens masks stop tokens before sampling (vLLM's and transformers' min_new_tokens),
    rather than only refusing to stop: the tokens drawn change, identically in both."""
    prompt = tiny_llm.tokenizer("def fibonacci(n):")["input_ids"]
    plain = tiny_llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    stop = plain[1]  # greedy decoding draws it second: min_tokens=6 must hold it back
    out = tiny_llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
        temperature=0.0, max_tokens=40, min_tokens=6, stop_token_ids=[stop], ignore_eos=True),
        use_tqdm=False)[0].outputs[0]
    assert stop not in out.token_ids[:6] and len(out.token_ids) >= 6
    ref = hf_model(model_path("tiny"))
    hf = ref.generate(input_ids=torch.tensor([prompt]), max_new_tokens=40, min_new_tokens=6,
                      do_sample=False, eos_token_id=[stop], pad_token_id=2)[0, len(prompt):].tolist()
    if stop in hf:  # transformers pads after the stop token
        hf = hf[:hf.index(stop) + 1]
    assert out.token_ids == hf
    assert out.finish_reason == ("stop" if stop in hf else "length")


def test_bundled_models_load_offline_with_transformers():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for name in ("tiny", "tiny-draft"):
        model = AutoModelForCausalLM.from_pretrained(model_path(name))
        cfg = model.config
        assert cfg.model_type == "llama" and cfg.num_key_value_heads < cfg.num_attention_heads
        tok = AutoTokenizer.from_pretrained(model_path(name))
        assert tok.decode(tok("def f(x):\n    return x")["input_ids"], skip_special_tokens=True) == \
            "def f(x):\n    return x"

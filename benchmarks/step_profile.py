"""Where a batch-1 decode step goes: engine.step() timed around model.forward, and torch.profiler
over 10 steps (self CPU time per op).

    python benchmarks/step_profile.py tiny            # float32
    python benchmarks/step_profile.py smollm2 gguf    # bf16, GGUF blocks kept quantized
"""
import sys
import time

import torch
torch.set_num_threads(1)
from llmopt import LLM, SamplingParams
from llmopt.model.registry import model_path
from torch.profiler import profile, ProfilerActivity
name, q = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
path = "tiny" if name == "tiny" else str(model_path("smollm2"))
llm = LLM(path, dtype="bfloat16" if q else "float32", quantization=q, num_kv_blocks=64, enable_prefix_caching=False)
eng = llm.llm_engine
model = eng.model
fwd_t = []
orig = model.forward
def timed(*a, **k):
    t = time.perf_counter(); r = orig(*a, **k); fwd_t.append(time.perf_counter() - t); return r
model.forward = timed

llm.generate(["warm up prompt with several tokens"], SamplingParams(max_tokens=4), use_tqdm=False)
eng.add_request("p", {"prompt_token_ids": list(range(100, 120))}, SamplingParams(max_tokens=200, ignore_eos=True, temperature=0))
eng.step(); eng.step()
fwd_t.clear()
N = 40
t0 = time.perf_counter()
for _ in range(N): eng.step()
wall = (time.perf_counter() - t0) / N
fwd = sorted(fwd_t)[len(fwd_t)//2]
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(10): eng.step()
ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
tot = sum(e.self_cpu_time_total for e in ops)
calls = sum(e.count for e in ops) / 10
print(f"{name} {q}: step {wall*1e3:.2f} ms (median forward {fwd*1e3:.2f} ms, outside forward {(wall-fwd)*1e3:.2f} ms); torch ops per step {calls:.0f}")
mm = sum(e.self_cpu_time_total for e in ops if e.key in ("aten::mm","aten::addmm","aten::_weight_int4pack_mm_for_cpu","aten::_weight_int8pack_mm","aten::linear"))
print(f"  matmul self share {mm/tot:.1%}")
for e in ops[:14]:
    print(f"  {e.key:55s} {e.self_cpu_time_total/tot:6.1%} {e.self_cpu_time_total/1e3/10:7.2f} ms/step {e.count/10:6.0f} calls/step")

"""Which step backend an engine runs, chosen once when it is built.

    StepBackend     the model's own forward, op by op, in torch (llmopt/worker/model_runner.py):
                    the reference; with enforce_eager=True the pool's attention is plain torch too,
                    so the step reads top to bottom with no compiled code in it.
    CompiledDecode  the CPU: every decoder layer of the step in one C++ call
                    (llmopt/worker/compiled_decode.py).
    GraphedDecode   CUDA: decode steps replayed as CUDA graphs over the Triton kernels
                    (llmopt/worker/cuda_graphs.py).

`ModelRunner.execute` calls `backend.forward` and `backend.compute_logits` every step, and nothing
above the backend chooses again; the tests hold all three to the same tokens.
"""

from __future__ import annotations

import torch

from llmopt.layers import sampler as plain_sampler
from llmopt.worker.compiled_decode import CompiledDecode, why_not, why_not_invariant
from llmopt.worker.cuda_graphs import GraphedDecode, why_not_graphs
from llmopt.worker.model_runner import StepBackend


def choose_step_backend(model, kv_cache, device, enforce_eager: bool = False, parallel: bool = False,
                        max_num_seqs: int = 256, max_blocks_per_seq: int = 0,
                        max_step_rows: int = 1 << 30, batch_invariant: bool = False) -> StepBackend:
    """The backend every step of this engine runs through; an eager one says why in its `path`.
    vLLM's enforce_eager: False runs the steps compiled (one C++ call on the CPU, CUDA graphs on a
    GPU, with buffers for max_num_seqs sequences of max_blocks_per_seq blocks) where they can run
    this model and pool; max_step_rows, the most tokens a step holds, tells the compiled CPU step
    whether it needs dense copies of quantized weights for rows beyond its block kernels.
    batch_invariant (enable_deterministic_inference) runs only compiled: where the step would be
    eager, a ValueError says why (the config has refused enforce_eager and CUDA already)."""
    if enforce_eager:  # the plain sampler too (llmopt/layers/sampler.py): nothing tuned in the step
        return StepBackend(model, kv_cache, "enforce_eager=True", sampler=plain_sampler)
    if parallel:
        return StepBackend(model, kv_cache, "tensor/pipeline parallel ranks")
    if torch.device(device).type == "cuda":
        why = why_not_graphs(model, kv_cache, device)
        return StepBackend(model, kv_cache, why) if why else GraphedDecode(model, kv_cache, max_num_seqs,
                                                                           max_blocks_per_seq)
    why = why_not(model, kv_cache, device)
    if batch_invariant:
        why = why or why_not_invariant(model)
        if why:
            raise ValueError(f"enable_deterministic_inference=True needs the compiled CPU step, which cannot "
                             f"run here: {why}")
    return StepBackend(model, kv_cache, why) if why else CompiledDecode(model, kv_cache, max_step_rows,
                                                                        batch_invariant)

"""What tensor and pipeline parallelism cost on real hardware, on paper.

Tensor parallelism all-reduces two hidden-sized vectors per token and layer (after o_proj
and after down_proj), `2 x layers x hidden x bytes` per token. A ring all-reduce over N
ranks sends and receives 2 (N - 1) / N of the payload per rank, so one all-reduce takes
about 2 (N-1)/N x bytes / bandwidth + a fixed latency (launch and synchronization, which
dominates the small all-reduces of decoding).
Pipeline parallelism sends one hidden-sized vector per token per stage boundary, but idles:
with m micro-batches in flight over p stages, (p - 1) / (m + p - 1) of the stage-time is
the bubble (GPipe, Huang et al. 2019).

The bandwidths are per direction, per GPU, as vendors state them; real all-reduces reach
70-85% of them (NCCL's "bus bandwidth"). The latencies are typical of a small all-reduce
over 8 GPUs with NCCL (order of magnitude only: they vary with the algorithm and the version).
"""

from __future__ import annotations

# (name, GB/s per direction per GPU, seconds of latency per all-reduce)
LINKS = {
    "NVLink 4 (H100 SXM)": (450.0, 10e-6),
    "NVLink 3 (A100 SXM)": (300.0, 10e-6),
    "PCIe 5.0 x16": (64.0, 25e-6),
    "PCIe 4.0 x16": (32.0, 25e-6),
    "InfiniBand NDR 400 Gb/s": (50.0, 30e-6),
    "InfiniBand HDR 200 Gb/s": (25.0, 30e-6),
    "Ethernet 100 Gb/s": (12.5, 60e-6),
}
HBM_GB_S = {"H100 SXM": 3350.0, "A100 SXM 80GB": 2039.0}


def tp_bytes_per_token(num_layers: int, hidden_size: int, dtype_bytes: int, embedding: bool = True) -> int:
    """All-reduce payload per token: two per layer, plus one for a vocab-parallel embedding."""
    return (2 * num_layers + int(embedding)) * hidden_size * dtype_bytes


def allreduce_seconds(payload_bytes: float, ranks: int, gb_per_s: float, latency: float) -> float:
    """One ring all-reduce of `payload_bytes` over `ranks` ranks."""
    if ranks < 2:
        return 0.0
    return 2 * (ranks - 1) / ranks * payload_bytes / (gb_per_s * 1e9) + latency


def tp_comm_seconds_per_step(tokens: int, num_layers: int, hidden_size: int, dtype_bytes: int,
                             ranks: int, link: str) -> float:
    """A step of `tokens` tokens: 2 all-reduces per layer of tokens x hidden numbers each."""
    bw, lat = LINKS[link]
    one = allreduce_seconds(tokens * hidden_size * dtype_bytes, ranks, bw, lat)
    return 2 * num_layers * one


def pp_bubble(stages: int, micro_batches: int) -> float:
    """Idle share of stage-time with `micro_batches` in flight over `stages` stages."""
    return (stages - 1) / (micro_batches + stages - 1)


def decode_weight_read_seconds(num_params: float, dtype_bytes: int, ranks: int, gpu: str = "H100 SXM") -> float:
    """A memory-bound decode step reads every weight once: each rank reads its 1/ranks share."""
    return num_params * dtype_bytes / ranks / (HBM_GB_S[gpu] * 1e9)

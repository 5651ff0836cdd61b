"""Disaggregated prefill and decode between two engines (llmopt/engine/kv_transfer.py): the decode
engine's greedy tokens equal one engine's, the prefill engine holds no block for a request it
handed on, the transfer file is gone once used, a damaged file is refused (recomputed), and bad
configurations and parameters are answered by name."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llmopt import LLM, SamplingParams

PROMPT = "Conversation: " + " ".join(f"w{j}" for j in range(60))


def connector(role: str, folder) -> dict:
    return {"kv_connector": "SharedMemoryConnector", "kv_role": role,
            "kv_connector_extra_config": {"path": str(folder)}}


def greedy(max_tokens: int, transfer: dict | None = None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens,
                          extra_args=None if transfer is None else {"kv_transfer_params": transfer})


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shm")
    return (LLM("tiny", num_kv_blocks=64), LLM("tiny", num_kv_blocks=64, kv_transfer_config=connector("kv_producer", folder)),
            LLM("tiny", num_kv_blocks=64, kv_transfer_config=connector("kv_consumer", folder)))


def prefill(pre: LLM, prompt: str = PROMPT) -> dict:
    out = pre.generate([prompt], greedy(1, {"do_remote_decode": True}), use_tqdm=False)[0]
    return out.kv_transfer_params


def test_disaggregated_tokens_equal_one_engines(engines):
    one, pre, dec = engines
    want = one.generate([PROMPT], greedy(12), use_tqdm=False)[0].outputs[0].token_ids
    params = prefill(pre)
    assert os.path.exists(params["remote_path"]) and params["remote_num_tokens"] > 0
    assert pre.llm_engine.block_manager.usage == 0  # the prefill engine holds nothing for it
    got = dec.generate([PROMPT], greedy(12, params), use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want
    assert got.num_cached_tokens == params["remote_num_tokens"]  # loaded, not computed
    assert not os.path.exists(params["remote_path"])  # removed once loaded
    assert dec.get_metrics()["kv_offload_hits_transfer"] >= params["remote_num_tokens"]


def test_a_damaged_transfer_is_recomputed(engines):
    one, pre, dec = engines
    prompt = "Another talk: " + " ".join(f"v{j}" for j in range(60))  # nothing of it in the decode pool yet
    want = one.generate([prompt], greedy(6), use_tqdm=False)[0].outputs[0].token_ids
    params = prefill(pre, prompt)
    with open(params["remote_path"], "r+b") as f:
        f.seek(-10, os.SEEK_END)
        f.write(b"\xff" * 10)
    refused = dec.get_metrics()["kv_offload_refused_blocks"]
    assert dec.generate([prompt], greedy(6, params), use_tqdm=False)[0].outputs[0].token_ids == want
    assert dec.get_metrics()["kv_offload_refused_blocks"] == refused + 1  # the last row's CRC failed
    assert not os.path.exists(params["remote_path"])


def test_a_decode_engine_whose_pool_evicts_still_loads_transfers(engines):
    # a consumer without an offload tier of its own: the blocks its pool evicts have nowhere to go (a
    # run of the lesson failed every request once this pool first reused a cached block)
    one, pre, _ = engines
    folder = pre.llm_engine.kv_connector.folder  # where the producer writes
    dec = LLM("tiny", num_kv_blocks=24, kv_transfer_config=connector("kv_consumer", folder))
    for k in range(4):  # four other prompts of about eight blocks each, through a pool of 24
        dec.generate([f"Talk {k}: " + " ".join(f"u{k}{j}" for j in range(60))], greedy(2), use_tqdm=False)
    prompt = "A late talk: " + " ".join(f"z{j}" for j in range(60))
    want = one.generate([prompt], greedy(6), use_tqdm=False)[0].outputs[0].token_ids
    params = prefill(pre, prompt)
    got = dec.generate([prompt], greedy(6, params), use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want and got.num_cached_tokens == params["remote_num_tokens"]
    assert dec.get_metrics()["num_failed"] == 0


def test_bad_transfers_are_named(engines, tmp_path):
    _, pre, dec = engines
    folder = Path(dec.llm_engine.kv_connector.folder)
    with pytest.raises(ValueError, match="cannot open"):
        dec.generate([PROMPT], greedy(2, {"remote_path": str(folder / "none.kv")}), use_tqdm=False)
    (folder / "junk.kv").write_bytes(b"not a transfer")
    with pytest.raises(ValueError, match="not a KV transfer file"):
        dec.generate([PROMPT], greedy(2, {"remote_path": str(folder / "junk.kv")}), use_tqdm=False)
    (folder / "junk.kv").unlink()
    elsewhere = prefill(pre)["remote_path"]
    moved = tmp_path / "moved.kv"
    os.replace(elsewhere, moved)  # a real transfer file, outside the folder the engines share
    with pytest.raises(ValueError, match="must name a file in this engine's transfer folder"):
        dec.generate([PROMPT], greedy(2, {"remote_path": str(moved)}), use_tqdm=False)
    assert moved.exists()  # refused before anything was opened or removed
    params = prefill(pre)
    with pytest.raises(ValueError, match="another prompt"):
        dec.generate(["Another prompt " * 20], greedy(2, params), use_tqdm=False)
    with pytest.raises(ValueError, match="kv_producer"):
        pre.generate([PROMPT], greedy(2, params), use_tqdm=False)
    assert dec.llm_engine.block_manager.usage == 0 and not dec.llm_engine.kv_connector.open


@pytest.mark.parametrize("cfg, words", [
    ({"kv_connector": "NixlConnector", "kv_role": "kv_both"}, "SharedMemoryConnector"),
    ({"kv_connector": "SharedMemoryConnector", "kv_role": "prefill"}, "kv_producer"),
    ({"kv_connector": "SharedMemoryConnector", "kv_role": "kv_both", "port": 1}, "unknown keys"),
    ({"kv_connector": "SharedMemoryConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"path": "/no/such/folder"}}, "existing folder"),
    ("kv_both", "must be a dict"),
])
def test_bad_kv_transfer_config_is_named(cfg, words):
    with pytest.raises((ValueError, TypeError), match=words):
        LLM("tiny", kv_transfer_config=cfg)

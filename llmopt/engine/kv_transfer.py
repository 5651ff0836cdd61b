"""Disaggregated prefill and decode: a finished prompt's KV handed from one engine to another.

A long prompt's prefill stalls every decode that shares its steps (chunked prefill, lesson 03,
only spreads the stall out). DistServe, Mooncake, vLLM's KV connectors and SGLang's
`--disaggregation-mode` run prompts and decodes in separate engines and ship the prompt's KV
blocks between them. Here, as vLLM spells it:

    kv_transfer_config={"kv_connector": "SharedMemoryConnector", "kv_role": "kv_producer"}  # prefill
    kv_transfer_config={"kv_connector": "SharedMemoryConnector", "kv_role": "kv_consumer"}  # decode

- **Producer** (the prefill engine). A request whose SamplingParams carry
  `extra_args={"kv_transfer_params": {"do_remote_decode": True}}` runs its prompt as usual. When it
  finishes, the full blocks of its prompt are written, with their token ids and a CRC-32 a block, to
  one file in shared memory (`/dev/shm` on Linux: pages both processes reach by name, no copy through
  a socket), and its blocks go back to the pool at once: the prefill engine holds nothing for a
  request it has handed on. The output's `kv_transfer_params` name the file.
- **Consumer** (the decode engine). A request carrying those `kv_transfer_params` opens the file as
  a read-only tier below its pool (llmopt/engine/kv_offload.py): the chained hashes of the prompt's
  blocks, computed here from the token ids, name the file's rows, and the prefix lookup at admission
  loads them as it loads offloaded blocks, each checked against its CRC. The prompt's last tokens
  (those not filling a block, at least one) are computed here: their logits give the first token.
  Once the request's first step has run, the file is removed.
"""

from __future__ import annotations

import json
import os
import struct
import uuid

import torch

from llmopt.engine.block_manager import hash_block
from llmopt.engine.kv_offload import TierIndex
from llmopt.worker.kv_tier import checksum

MAGIC = b"LLMOPT-KV-TRANSFER-1\n"
ALIGN = 4096


def write_transfer(folder: str, token_ids: list[int], rows: torch.Tensor, block_size: int) -> str:
    """One file: MAGIC, the header's length, the header (JSON: block size, row bytes, the token ids
    the rows hold, a CRC-32 a row), then the rows from the next multiple of 4 KiB. Written under a
    temporary name and renamed, so a reader never sees half a file."""
    header = json.dumps({"block_size": block_size, "row_bytes": rows.shape[1], "token_ids": token_ids,
                         "crcs": [checksum(r) for r in rows]}).encode()
    start = -(-(len(MAGIC) + 8 + len(header)) // ALIGN) * ALIGN
    path = os.path.join(folder, f"llmopt-{uuid.uuid4().hex}.kv")
    with open(path + ".part", "wb") as f:
        f.write(MAGIC + struct.pack("<Q", len(header)) + header)
        f.seek(start)
        f.write(rows.numpy().tobytes())
    os.replace(path + ".part", path)
    return path


class TransferFile:
    """A transfer file as a read-only tier: `read(slot, out)` as DiskTier's; ValueError on open if the
    file is not one, or its blocks are not this pool's."""

    kind = "transfer"

    def __init__(self, path: str, row_bytes: int, block_size: int):
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise ValueError(f"kv_transfer_params: cannot open the transfer file {path!r} ({e.strerror})") from None
        try:
            head = os.pread(self.fd, len(MAGIC) + 8, 0)
            if head[:len(MAGIC)] != MAGIC:
                raise ValueError(f"kv_transfer_params: {path!r} is not a KV transfer file")
            (n,) = struct.unpack("<Q", head[len(MAGIC):])
            self.header = json.loads(os.pread(self.fd, n, len(MAGIC) + 8))
            self.start = -(-(len(MAGIC) + 8 + n) // ALIGN) * ALIGN
            if (self.header["row_bytes"], self.header["block_size"]) != (row_bytes, block_size):
                raise ValueError(f"kv_transfer_params: {path!r} holds blocks of {self.header['block_size']} tokens, "
                                 f"{self.header['row_bytes']} bytes each; this engine's are {block_size} tokens, "
                                 f"{row_bytes} bytes (the two engines must run the same model, dtype and KV dtype)")
        except (ValueError, KeyError, struct.error) as e:
            os.close(self.fd)
            raise ValueError(str(e) if isinstance(e, ValueError) else f"kv_transfer_params: {path!r}: bad header") from None
        self.num_slots, self.nbytes = len(self.header["crcs"]), row_bytes

    def read(self, slot: int, out: torch.Tensor) -> bool:
        return os.preadv(self.fd, [out.numpy()], self.start + slot * self.nbytes) == self.nbytes

    def close(self, remove: bool = True) -> None:
        """Close and remove the file (its rows are in the pool now, or will be computed); `remove=False`:
        only close it (a request it was not meant for)."""
        os.close(self.fd)
        if remove:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class SharedMemoryConnector:
    """One engine's side of the transfer (`role`: kv_producer, kv_consumer or kv_both), over the
    engine's block manager (an OffloadingCache: its `offload` reads the consumer's files)."""

    def __init__(self, config: dict, block_manager, block_size: int):
        self.role, self.folder = config["kv_role"], config["kv_connector_extra_config"]["path"]
        self.bm, self.block_size = block_manager, block_size
        self.open: dict[str, TierIndex] = {}  # consumer: request id -> its transfer file, until its first step
        self.num_sent = self.num_received = 0

    # -- producer --------------------------------------------------------------------------------
    def send(self, seq) -> dict | None:
        """A finishing request that asked for it (kv_transfer_params' do_remote_decode): write the full
        blocks of its prompt (those a consumer's lookup can use: all but the last token's block) and
        return the kv_transfer_params that name them; None for any other request."""
        params = (seq.params.extra_args or {}).get("kv_transfer_params") or {}
        if self.role == "kv_consumer" or not params.get("do_remote_decode") or seq.finish_reason == "error":
            return None
        prompt = list(seq.prompt_token_ids)
        n = (len(prompt) - 1) // self.block_size
        table = self.bm.block_tables.get(seq.request_id, [])[:n]
        rows = self.bm.offload.rows.gather(table) if table else torch.empty((0, self.bm.offload.rows.nbytes),
                                                                              dtype=torch.uint8)
        path = write_transfer(self.folder, prompt[:len(table) * self.block_size], rows, self.block_size)
        self.num_sent += 1
        return {"remote_path": path, "remote_num_tokens": len(table) * self.block_size}

    # -- consumer --------------------------------------------------------------------------------
    def check(self, params: dict, prompt: list[int]) -> None:
        """ValueError naming what is wrong with a request's kv_transfer_params, before admission."""
        unknown = set(params) - {"do_remote_decode", "remote_path", "remote_num_tokens"}
        if unknown:
            raise ValueError(f"kv_transfer_params: unknown keys {sorted(unknown)}; allowed: do_remote_decode "
                             "(to a prefill engine), remote_path and remote_num_tokens (what it answered)")
        if params.get("do_remote_decode") and self.role == "kv_consumer":
            raise ValueError("kv_transfer_params asks to send this prompt's KV on (do_remote_decode), but this "
                             "engine's kv_role is kv_consumer (it receives, it does not send)")
        if params.get("remote_path") is not None:
            self._open(params, prompt).close(remove=False)

    def _open(self, params: dict, prompt: list[int]) -> TransferFile:
        if self.role == "kv_producer":
            raise ValueError("kv_transfer_params names a transfer file, but this engine's kv_role is kv_producer "
                             "(it sends, it does not receive)")
        path = params["remote_path"]
        if not isinstance(path, str):
            raise ValueError(f"kv_transfer_params['remote_path'] must be a string, got {path!r}")
        # only files of the folder both engines were given: the file is removed once read, and a
        # request must not be able to have the server open (or delete) anything else
        if os.path.dirname(os.path.realpath(path)) != os.path.realpath(self.folder):
            raise ValueError(f"kv_transfer_params['remote_path'] must name a file in this engine's transfer folder "
                             f"{self.folder!r} (kv_connector_extra_config's path), got {path!r}")
        store = TransferFile(path, self.bm.offload.rows.nbytes, self.block_size)
        tokens = store.header["token_ids"]
        if list(prompt[:len(tokens)]) != tokens:
            store.close(remove=False)
            raise ValueError(f"kv_transfer_params: {path!r} holds the KV of another prompt")
        return store

    def receive(self, seq) -> None:
        """Open the file `seq`'s kv_transfer_params name as a tier its admission will load from
        (ValueError if it is not usable: its tokens must begin `seq`'s prompt)."""
        params = (seq.params.extra_args or {}).get("kv_transfer_params") or {}
        if params.get("remote_path") is None:
            return
        store = self._open(params, list(seq.prompt_token_ids))
        tokens = store.header["token_ids"]
        tier, h = TierIndex(store), None
        for i, crc in enumerate(store.header["crcs"]):
            h = hash_block(h, tuple(tokens[i * self.block_size:(i + 1) * self.block_size]))
            tier.entries[h] = (i, crc)
        self.bm.offload.remote.append(tier)
        self.open[seq.request_id] = tier
        self.num_received += 1

    def release(self, request_id: str) -> None:
        """The request's first step ran (its blocks are loaded), or it left: drop its file."""
        tier = self.open.pop(request_id, None)
        if tier is not None:
            self.bm.offload.remote.remove(tier)
            self.bm.offload.transfer_hit_tokens += tier.hit_tokens
            tier.store.close()

    def close(self) -> None:
        for rid in list(self.open):
            self.release(rid)


def make_connector(config, block_manager) -> SharedMemoryConnector | None:
    """The engine's connector, or None without kv_transfer_config."""
    if config.kv_transfer_config is None:
        return None
    return SharedMemoryConnector(config.kv_transfer_config, block_manager, config.block_size)

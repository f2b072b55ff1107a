"""A router's end of vLLM's KV-event stream (a real ZMQ SUB socket and the replay socket) and
the view a router rebuilds from it; shared by the KV-event unit tests and the server tests."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from tests.harness.openai_server import free_port

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventSubscriber:
    """A router's end of vLLM's KV-event stream, on 127.0.0.1 only.

    The SUB socket binds and vLLM's publisher connects to it (a ``tcp://127.0.0.1:port``
    endpoint makes vLLM connect; only wildcard endpoints bind). Batches a slow join missed are
    fetched from the publisher's replay socket, which answers from its buffer by sequence."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        port = self.sub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.batches: dict[int, KVEventBatch] = {}

    def config(self) -> dict[str, Any]:
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
        }

    def _add(self, seq: bytes, payload: bytes) -> None:
        self.batches[int.from_bytes(seq, "big", signed=True)] = self.decoder.decode(payload)

    def drain(self, quiet_s: float = 0.3) -> list[Any]:
        """Every event published so far, in order."""
        while self.sub.poll(int(quiet_s * 1000)):
            _topic, seq, payload = self.sub.recv_multipart()
            self._add(seq, payload)
        self._replay_missing()
        return [ev for seq in sorted(self.batches) for ev in self.batches[seq].events]

    def _replay_missing(self) -> None:
        seqs = sorted(self.batches)
        start = next((i for i, s in enumerate(seqs) if s != i), len(seqs))
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while dealer.poll(5000):
                _empty, _topic, seq, payload = dealer.recv_multipart()
                if seq == END_SEQ:
                    return
                self._add(seq, payload)
            raise AssertionError("the replay socket did not answer")
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


class RouterView:
    """What a router believes each medium and group holds, from the event stream alone.

    ``AllBlocksCleared`` comes from vLLM's GPU block pool (a prefix-cache reset): it clears the
    GPU medium; our tiers announce their own removals (a connector reset removes each block)."""

    def __init__(self, events: list[Any]) -> None:
        self.held: dict[tuple[str | None, int | None], set[int]] = defaultdict(set)
        self.stored: dict[tuple[str | None, int | None], list[BlockStored]] = defaultdict(list)
        self.removed: dict[tuple[str | None, int | None], int] = defaultdict(int)
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                for key, held in self.held.items():
                    if key[0] == "GPU":
                        held.clear()
                continue
            key = (ev.medium, ev.group_idx)
            if isinstance(ev, BlockStored):
                self.held[key].update(ev.block_hashes)
                self.stored[key].append(ev)
            elif isinstance(ev, BlockRemoved):
                self.held[key].difference_update(ev.block_hashes)
                self.removed[key] += len(ev.block_hashes)


def per_block(events: list[BlockStored]) -> dict[int, list[int]]:
    """Block hash -> its tokens, from stored events (each carries its blocks' tokens in order)."""
    out = {}
    for ev in events:
        assert ev.block_size > 0, "a described store"
        for k, h in enumerate(ev.block_hashes):
            out[h] = ev.token_ids[k * ev.block_size : (k + 1) * ev.block_size]
    return out

"""LoRA requests' storage keys carry the adapter's *weights*: two instances sharing storage and
serving different versions of an adapter under one name and path never read each other's
objects; the same weights share them."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("lmcache")
safetensors_torch = pytest.importorskip("safetensors.torch")

from himamba.connector.protocol import FetchItem, FetchOrder, ObjectKind  # noqa: E402
from himamba.connector.scheduler.lora_identity import LoraTags  # noqa: E402
from himamba.connector.worker.worker_storage import WorkerStorage  # noqa: E402
from himamba.tiers.cpu_pool import HostSlotPool  # noqa: E402
from himamba.tiers.object_format import HEADER_SIZE  # noqa: E402
from tests.harness.stores import make_store  # noqa: E402
from tests.unit.tiers.pool_helpers import read_slot, write_slot  # noqa: E402


def adapter(root: Path, seed: int, rank: int = 4) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    weights = {
        "lora_A": torch.randn(rank, 64, generator=g),
        "lora_B": torch.randn(64, rank, generator=g),
    }
    safetensors_torch.save_file(weights, str(root / "adapter_model.safetensors"))
    (root / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 8}))
    return root


def lora(path: Path, lora_id: int = 1) -> SimpleNamespace:
    return SimpleNamespace(lora_name="support-bot", lora_int_id=lora_id, lora_path=str(path))


def test_an_adapter_tag_follows_its_weights_not_its_name_or_path(tmp_path):
    v1 = adapter(tmp_path / "a", seed=1)
    tag_v1 = LoraTags().tag(lora(v1))
    same_weights_elsewhere = adapter(tmp_path / "b", seed=1)
    assert LoraTags().tag(lora(same_weights_elsewhere)) == tag_v1
    adapter(v1, seed=2)  # a new version written to the same path, same name
    assert LoraTags().tag(lora(v1)) != tag_v1
    assert LoraTags().tag(None) == ""


def worker(tmp_path: Path) -> WorkerStorage:
    pools = {
        ObjectKind.KV: HostSlotPool([48, 16], 4, head_bytes=HEADER_SIZE, spares=2),
        ObjectKind.MAMBA: HostSlotPool([32], 2, head_bytes=HEADER_SIZE, spares=2),
    }
    return WorkerStorage(make_store(str(tmp_path / "store")), pools, 0, None, "write_through")


def fetch_ok(ws: WorkerStorage, tag: str) -> bool:
    import time

    ws.fetch([FetchOrder(1, (FetchItem(ObjectKind.KV, b"L" * 32, 3),), lora_tag=tag)])
    deadline = time.monotonic() + 10
    while ws.outstanding() and time.monotonic() < deadline:
        ws.poll()
        time.sleep(0.01)
    (ack,) = ws.take_acks()
    return ack.ok == (True,)


def test_an_object_written_for_one_adapter_version_is_not_read_for_another(tmp_path):
    tag_v1 = LoraTags().tag(lora(adapter(tmp_path / "v1", seed=1)))
    tag_v2 = LoraTags().tag(lora(adapter(tmp_path / "v2", seed=2)))
    writer = worker(tmp_path)
    pool = writer.pools[ObjectKind.KV]
    write_slot(pool, 0, torch.full((pool.slot_bytes,), 5, dtype=torch.uint8))
    writer.on_stored(ObjectKind.KV, [0], [b"L" * 32], "", [tag_v1])
    writer.close()  # flushes the write
    reader = worker(tmp_path)
    assert not fetch_ok(reader, tag_v2)  # same block hash, other weights: a miss
    assert fetch_ok(reader, tag_v1)
    assert bool((read_slot(reader.pools[ObjectKind.KV], 3) == 5).all())
    reader.close()

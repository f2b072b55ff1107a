"""Storage audit for the churn soak: after the run, every object left in every store directory is
read and its bytes compared with what the stand-in runner computes for that prefix (a wrong
object in storage is as bad as a wrong hit, only later)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .engine import LifecycleEngine
from .plan_audit import KV_KIND, MAMBA_KIND, PlanAudit
from .prefix_bytes import TokenChain, salt_seed


@dataclass
class _Prefix:
    tokens: np.ndarray  # uint32, the request's tokens (shared by all its blocks)
    index: int  # block index: the hash names tokens[: (index + 1) * block_size]
    salt: str | None
    # A partial tail (scheduler.tails): the name covers tokens[: index * block_size + tail],
    # its page's first `tail` rows are the prefix's and the rest is never read.
    tail: int = 0

    def length(self, block_size: int) -> int:
        return self.index * block_size + self.tail if self.tail else (self.index + 1) * block_size


class PrefixOracle:
    """vLLM block hash -> the tokens (and cache salt) it names, recorded from each request as
    the scheduler finishes it (``request_finished_all_groups`` sees its final block hashes)."""

    def __init__(self, engine: LifecycleEngine) -> None:
        self.block_size = engine.kv.block_size
        self.hashes: dict[bytes, _Prefix] = {}
        self.requests = 0
        conn = engine.connector
        real = conn.request_finished_all_groups

        def recorded(request: Any, block_ids: Any) -> Any:
            self.note(request)
            return real(request, block_ids)

        conn.request_finished_all_groups = recorded

    def note(self, request: Any) -> None:
        self.requests += 1
        tokens: np.ndarray | None = None
        for i, h in enumerate(request.block_hashes):
            h = bytes(h)
            if h in self.hashes:
                continue
            if tokens is None:
                tokens = np.asarray(list(request.all_token_ids), dtype=np.uint32)
            self.hashes[h] = _Prefix(tokens, i, request.cache_salt)
        self._note_tail(request)

    def _note_tail(self, request: Any) -> None:
        """The name a partial tail of ``request`` gets (whether or not the connector kept one:
        an unknown name in storage is a problem either way)."""
        from himamba.connector.scheduler.tails import tail_hash

        bs = self.block_size
        p, length = divmod(request.num_computed_tokens, bs)
        if not p or not length or len(request.block_hashes) < p:
            return
        if request.num_computed_tokens > request.num_tokens:
            return  # a forward in flight took a token vLLM had not seen: no tail (tails.keep)
        ids = list(request.all_token_ids)
        name = tail_hash(bytes(request.block_hashes[p - 1]), ids[p * bs : p * bs + length])
        if name not in self.hashes:
            self.hashes[name] = _Prefix(
                np.asarray(ids, dtype=np.uint32), p, request.cache_salt, length
            )

    def chain(self, block_hash: bytes, model_epoch: int) -> tuple[TokenChain, int] | None:
        """The digest chain of the prefix ``block_hash`` names, and that prefix's length."""
        p = self.hashes.get(block_hash)
        if p is None:
            return None
        n = p.length(self.block_size)
        chain = TokenChain(self.block_size, salt_seed(p.salt, model_epoch))
        chain.append([int(t) for t in p.tokens[:n]])
        return chain, n


# -- run-time control ---------------------------------------------------------------------


# -- the storage audit ----------------------------------------------------------------------


@dataclass
class StorageAudit:
    objects: int = 0
    checked: int = 0
    by_kind: Counter = field(default_factory=Counter)
    invalid: Counter = field(default_factory=Counter)  # validate_object's reason
    unknown_epoch: int = 0  # salt tag of no epoch any plan used
    unknown_hash: int = 0  # a block hash no finished request had
    ambiguous_epoch: int = 0  # an epoch used under more than one model epoch
    wrong: list[str] = field(default_factory=list)  # valid objects with the wrong bytes
    by_dir: dict[str, int] = field(default_factory=dict)

    def problems(self) -> list[str]:
        out = list(self.wrong[:10])
        if len(self.wrong) > 10:
            out.append(f"... {len(self.wrong) - 10} more wrong objects")
        if self.invalid:
            out.append(f"invalid objects: {dict(self.invalid)}")
        for name in ("unknown_epoch", "unknown_hash", "ambiguous_epoch"):
            if getattr(self, name):
                out.append(f"{name}: {getattr(self, name)}")
        return out

    def summary(self) -> dict[str, Any]:
        return {
            "objects": self.objects,
            "checked": self.checked,
            "by_kind": dict(self.by_kind),
            "wrong": len(self.wrong),
            "invalid": dict(self.invalid),
            "unknown_epoch": self.unknown_epoch,
            "unknown_hash": self.unknown_hash,
            "ambiguous_epoch": self.ambiguous_epoch,
            "by_dir": self.by_dir,
        }


def _layer_indices(engine: LifecycleEngine) -> dict[str, int]:
    runner = engine.runners[0]
    return {
        layer.name: layer.index for layers in runner.layers_by_group.values() for layer in layers
    }


def expected_payload(
    engine: LifecycleEngine, chain: TokenChain, n: int, kind: int, rank: int
) -> tuple[np.ndarray, np.ndarray]:
    """The bytes the stand-in runner computes for the object of kind ``kind`` that names the
    prefix of ``n`` tokens: per layer (layout order) the block's attention rows, or the Mamba
    state after exactly ``n`` tokens; and which of them are read (a partial tail's page holds
    ``n % block_size`` rows of its prefix, the rest is never read)."""
    layout = engine.connector.layout
    model, bs = engine.model, engine.kv.block_size
    index = _layer_indices(engine)
    parts, read = [], []
    groups = layout.attention if kind == KV_KIND else layout.mamba
    start = (n - 1) // bs * bs
    for g in groups:
        for name in g.layer_names:
            if kind == KV_KIND:
                rows = model.attention_rows(chain, start, n, index[name], rank).reshape(-1)
                part = np.zeros(g.layer_block_bytes, dtype=np.uint8)
                part[: rows.size] = rows
                mask = np.zeros(part.size, dtype=bool)
                mask[: rows.size] = True
            else:
                part = model.mamba_state(chain, n, index[name], rank)
                mask = np.ones(part.size, dtype=bool)
            assert part.size == g.layer_block_bytes, (name, part.size, g.layer_block_bytes)
            parts.append(part)
            read.append(mask)
    return np.concatenate(parts), np.concatenate(read)


def payload_matches(
    engine: LifecycleEngine, payload: np.ndarray, chain: TokenChain, n: int, kind: int, rank: int
) -> bool:
    want, read = expected_payload(engine, chain, n, kind, rank)
    return bool(np.array_equal(payload[read], want[read]))


def _describe_found(engine: LifecycleEngine, payload: np.ndarray, kind: int) -> str:
    """The first attention row (or the first layer's Mamba state) of a stored payload."""
    layout = engine.connector.layout
    first = (layout.attention if kind == KV_KIND else layout.mamba)[0].layer_block_bytes
    head = payload[: engine.model.attn_row_bytes] if kind == KV_KIND else payload[:first]
    return engine.model.describe(head, state=kind != KV_KIND)


def audit_storage(
    engine: LifecycleEngine, dirs: list[Path], oracle: PrefixOracle, plans: PlanAudit
) -> StorageAudit:
    """Read every object in every store directory; each must validate under its own key and
    hold exactly the bytes of the prefix its block hash names (in the model epoch of its
    storage epoch)."""
    from himamba.connector.storage_setup import storage_config, storage_namespace
    from himamba.tiers.object_format import (
        HEADER_SIZE,
        ObjectKind,
        StorageKey,
        key_digest,
        resolve_algo,
        salt_tag,
        validate_object,
    )

    audit = StorageAudit()
    layout = engine.connector.layout
    world = engine.spec.tensor_parallel_size
    scfg = storage_config({"url": f"file://{dirs[0]}"})
    namespaces = [storage_namespace(engine.vllm_config, layout, r, scfg) for r in range(world)]
    tags = {ns.model_tag(): r for r, ns in enumerate(namespaces)}
    algo = resolve_algo(scfg.checksum)
    by_tag = {salt_tag(e): e for e in plans.epochs}
    payload_bytes = {KV_KIND: layout.kv_slot_bytes, MAMBA_KIND: layout.mamba_slot_bytes}
    chains: dict[tuple[bytes, int], tuple[TokenChain, int] | None] = {}
    for d in dirs:
        count = 0
        for path in sorted(Path(d).rglob("*.data")):
            parts = path.name[: -len(".data")].split("@")
            if len(parts) < 4 or parts[0] not in tags:
                continue
            kind = int(parts[2], 16)
            if kind not in payload_bytes:
                continue  # breaker health probes
            count += 1
            audit.objects += 1
            audit.by_kind["kv" if kind == KV_KIND else "mamba"] += 1
            rank = tags[parts[0]]
            block_hash = bytes.fromhex(parts[3])
            epoch = by_tag.get(parts[4] if len(parts) > 4 else "")
            if epoch is None:
                audit.unknown_epoch += 1
                continue
            model_epochs = plans.epochs[epoch]
            if len(model_epochs) != 1:
                audit.ambiguous_epoch += 1
            data = path.read_bytes()
            ns = namespaces[rank]
            reason = validate_object(
                memoryview(data),
                kind=ObjectKind(kind),
                payload_nbytes=payload_bytes[kind],
                layout_digest=ns.digest(),
                key_dig=key_digest(ns, StorageKey(block_hash, ObjectKind(kind), epoch)),
                algo=algo,
            )
            if reason is not None:
                audit.invalid[reason] += 1
                continue
            if block_hash not in oracle.hashes:
                audit.unknown_hash += 1
                continue
            payload = np.frombuffer(data, dtype=np.uint8, offset=HEADER_SIZE)
            audit.checked += 1
            n = 0
            for model_epoch in sorted(model_epochs):
                key = (block_hash, model_epoch)
                if key not in chains:
                    chains[key] = oracle.chain(block_hash, model_epoch)
                found = chains[key]
                assert found is not None
                chain, n = found
                if payload_matches(engine, payload, chain, n, kind, rank):
                    break
            else:
                what = "KV block" if kind == KV_KIND else "Mamba state"
                stale = [
                    m
                    for m in range(engine.model.epoch + 1)
                    if m not in model_epochs
                    and payload_matches(engine, payload, *oracle.chain(block_hash, m), kind, rank)
                ]
                whose = (
                    f"this prefix's bytes of model epoch {stale[0]} (stale)"
                    if stale
                    else "bytes of another prefix"
                )
                audit.wrong.append(
                    f"{Path(d).name}: {what} {block_hash.hex()[:16]} (epoch {epoch!r}, model "
                    f"epochs {sorted(model_epochs)}, prefix of {n} tokens, rank {rank}) holds "
                    f"{whose} [{_describe_found(engine, payload, kind)}]"
                )
        audit.by_dir[Path(d).name] = count
    return audit

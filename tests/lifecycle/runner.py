"""A stand-in for one TP rank's model runner: vLLM's worker-side call order, fake math.

Per step, in the order vLLM 0.32's GPUModelRunner (MRv1, what the CPU platform runs) uses:
``handle_preemptions`` -> state update (drop finished, zero new blocks, CoW copies, block
tables) -> ``preprocess_mamba`` (copy the previous running state into this step's column for
new/resumed requests and block crossings) -> bind metadata -> ``start_load_kv`` before the
forward only if the step has sync loads -> CHECK -> forward -> ``start_load_kv`` (async
case) -> ``wait_for_save`` -> ``get_transfer_results`` / ``get_block_ids_with_load_errors`` /
stats / ``build_connector_worker_meta`` -> clear.

Model Runner V2 (``vllm/v1/worker/gpu``, a GPU engine's default) moves the first hook: state
update -> Mamba pre-copy -> ``pre_forward`` (``handle_preemptions``, bind, sync loads) -> the
rest as above. Its new blocks are zeroed and written before the connector sees the step,
unless himamba's step-start hook (which wraps V2's ``execute_model``) runs first.

CHECK reads every byte the forward would read: all computed attention rows of each scheduled
request, and the Mamba running state it starts from. The forward then writes this step's
rows and the state at the step's end into the block vLLM's align-mode table names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace

from .prefix_bytes import HEADER_BYTES, TAG_AT, CacheMismatch, PrefixModel, TokenChain
from .vllm_setup import VOCAB_SIZE


def _byte_pages(t: torch.Tensor, num_blocks: int) -> np.ndarray:
    """``t`` (block axis 0) as a numpy uint8 ``[num_blocks, content bytes]`` view (no copy)."""
    es = t.element_size()
    content = t[0].numel() * es
    raw = torch.empty(0, dtype=torch.uint8)
    raw.set_(
        t.untyped_storage(), t.storage_offset() * es, (num_blocks, content), (t.stride(0) * es, 1)
    )
    return raw.numpy()


@dataclass
class _Layer:
    name: str
    index: int  # position in the model, written into every header
    pages: np.ndarray  # uint8 [num_blocks, content bytes]


@dataclass
class _Req:
    chain: TokenChain
    prompt_len: int
    block_ids: list[list[int]]
    num_computed: int = 0
    mamba_state_idx: int | None = None


@dataclass
class StepCounters:
    rows_checked: int = 0
    states_checked: int = 0
    steps: int = 0
    # Requests whose computed prefix CHECK read at least once (all their rows and state), and
    # requests that arrived at a worker with a computed prefix (a cache hit of any tier).
    requests_checked: set[str] = field(default_factory=set)
    requests_from_cache: set[str] = field(default_factory=set)


@dataclass
class StandInRunner:
    rank: int
    kv_cache_config: KVCacheConfig
    connector: Any  # the worker-role HiMambaConnector (None: engine without connector)
    kv_caches: dict[str, torch.Tensor]
    model: PrefixModel
    async_scheduling: bool = False
    model_runner_v2: bool = False  # V2's call order (see the module docstring)
    verify: bool = True
    write: bool = True
    requests: dict[str, _Req] = field(default_factory=dict)
    # Digest-chain seed per request (cache salt + model epoch), set by the engine on arrival:
    # NewRequestData carries neither.
    seeds: dict[str, int] = field(default_factory=dict)
    counters: StepCounters = field(default_factory=StepCounters)

    def __post_init__(self) -> None:
        num_blocks = self.kv_cache_config.num_blocks
        self.block_size = self.model.block_size
        self.attn_groups: list[int] = []
        self.mamba_groups: list[int] = []
        self.layers_by_group: dict[int, list[_Layer]] = {}
        order = {name: i for i, name in enumerate(sorted(self.kv_caches, key=_layer_number))}
        for gid, group in enumerate(self.kv_cache_config.kv_cache_groups):
            is_mamba = isinstance(group.kv_cache_spec, MambaSpec)
            (self.mamba_groups if is_mamba else self.attn_groups).append(gid)
            self.layers_by_group[gid] = [
                _Layer(n, order[n], _byte_pages(self.kv_caches[n], num_blocks))
                for n in group.layer_names
            ]

    # -- the step ------------------------------------------------------------------------
    def execute(self, so: SchedulerOutput, metadata: Any) -> ModelRunnerOutput:
        conn = self.connector
        self.counters.steps += 1
        if conn is not None and self.model_runner_v2 and conn.step_hook_installed:
            conn.himamba_step_start(metadata)  # runner_v2_hook's wrapped execute_model
        if conn is not None and not self.model_runner_v2:
            conn.handle_preemptions(metadata)
        self._update_states(so)
        sampled: dict[str, list[int]] = {}
        if so.total_num_scheduled_tokens:
            self._preprocess_mamba(so)
        if conn is not None and self.model_runner_v2:
            conn.handle_preemptions(metadata)  # ActiveKVConnector.pre_forward
        if conn is not None:
            # The real runner passes its forward context; HiMamba's hooks do not read it.
            conn.bind_connector_metadata(metadata)
            if so.has_sync_kv_loads:
                conn.start_load_kv(None)
        if so.total_num_scheduled_tokens:
            if self.verify:
                self._check_step(so)
            sampled = self._forward_step(so)
        kv_out = None if conn is None else self._finish_connector_step(so)
        req_ids = list(sampled)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled[r] for r in req_ids],
            kv_connector_output=kv_out,
        )

    def _finish_connector_step(self, so: SchedulerOutput) -> KVConnectorOutput:
        """What KVConnectorModelRunnerMixin does after the forward."""
        conn = self.connector
        if not so.has_sync_kv_loads:
            conn.start_load_kv(None)
        conn.wait_for_save()
        results = conn.get_transfer_results(so.finished_req_ids)
        kv_out = KVConnectorOutput(
            finished_sending=results.finished_sending,
            finished_recving=results.finished_recving,
            failed_recving=set(results.failed_recving or ()),
            invalid_block_ids=conn.get_block_ids_with_load_errors(),
            kv_connector_stats=conn.get_kv_connector_stats(),
            kv_cache_events=conn.get_kv_connector_kv_cache_events(),
            kv_connector_worker_meta=conn.build_connector_worker_meta(),
        )
        conn.clear_connector_metadata()
        return kv_out

    # -- state updates (GPUModelRunner._update_states) -------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            self.seeds.pop(req_id, None)
        if self.model_runner_v2:
            # V2 drops preempted requests; vLLM's scheduler sends them back as new ones, with
            # every token they hold as ``prefill_token_ids``.
            for req_id in set(so.preempted_req_ids or ()) - set(so.finished_req_ids):
                req = self.requests.pop(req_id, None)
                if req is not None:
                    self.seeds[req_id] = req.chain.seed
        if so.new_block_ids_to_zero:
            ids = np.asarray(so.new_block_ids_to_zero, dtype=np.int64)
            for layers in self.layers_by_group.values():
                for layer in layers:
                    layer.pages[ids] = 0
        if so.kv_cache_block_copies:
            copy_kv_cache_blocks_inplace(
                self.kv_caches.values(), self.kv_cache_config.num_blocks, so.kv_cache_block_copies
            )
        for new in so.scheduled_new_reqs:
            prompt = list(new.prompt_token_ids or ())
            chain = TokenChain(self.block_size, self.seeds.pop(new.req_id))
            # V2 sends every token a request holds (a resumed one's outputs included).
            held = getattr(new, "prefill_token_ids", None) if self.model_runner_v2 else None
            chain.append(prompt if held is None else list(held))
            self.requests[new.req_id] = _Req(
                chain, len(prompt), [list(b) for b in new.block_ids], new.num_computed_tokens
            )
            if new.num_computed_tokens:
                self.counters.requests_from_cache.add(new.req_id)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            req = self.requests[req_id]
            req.num_computed = cached.num_computed_tokens[i]
            prompt_len = req.prompt_len
            num_output = cached.num_output_tokens[i]
            if req_id in cached.resumed_req_ids:
                new_ids = cached.new_block_ids[i]
                assert new_ids is not None
                req.block_ids = [list(b) for b in new_ids]
                all_ids = cached.all_token_ids.get(req_id)
                if self.async_scheduling and all_ids is not None and num_output > 0:
                    req.chain.truncate(prompt_len)
                    req.chain.append(list(all_ids[-num_output:]))
            elif cached.new_block_ids[i] is not None:
                for ids, extra in zip(req.block_ids, cached.new_block_ids[i], strict=True):
                    ids.extend(extra)
            # Output tokens the scheduler discarded (e.g. a failed sync load) are dropped.
            if prompt_len + num_output < len(req.chain.tokens):
                req.chain.truncate(prompt_len + num_output)

    # -- preprocess_mamba (vllm/v1/worker/mamba_utils.py) ----------------------------------
    def _preprocess_mamba(self, so: SchedulerOutput) -> None:
        cached = so.scheduled_cached_reqs
        stale = set(so.finished_req_ids) | set(so.preempted_req_ids or ()) | cached.resumed_req_ids
        for req_id in stale:
            req = self.requests.get(req_id)
            if req is not None:
                req.mamba_state_idx = None
        bs = self.block_size
        for req_id, num_new in so.num_scheduled_tokens.items():
            req = self.requests[req_id]
            prev = req.mamba_state_idx
            if prev is None:  # new or resumed: the state it resumes from (-1 when none)
                prev = (req.num_computed - 1) // bs
            curr = -(-(req.num_computed + num_new) // bs) - 1
            req.mamba_state_idx = curr
            if prev != -1 and prev != curr:
                for gid in self.mamba_groups:
                    src, dst = req.block_ids[gid][prev], req.block_ids[gid][curr]
                    for layer in self.layers_by_group[gid]:
                        layer.pages[dst] = layer.pages[src]

    # -- CHECK ---------------------------------------------------------------------------
    def _check_step(self, so: SchedulerOutput) -> None:
        """Every byte this step's forward reads, for all scheduled requests at once (one gather
        per layer: CHECK runs every step of the 100k-request soak)."""
        reqs = [
            (rid, self.requests[rid])
            for rid in so.num_scheduled_tokens
            if self.requests[rid].num_computed
        ]
        if not reqs:
            return
        self.counters.requests_checked.update(rid for rid, _ in reqs)
        bs = self.block_size
        for gid in self.attn_groups:
            blocks, rows, headers, bounds = [], [], [], [0]
            for _, req in reqs:
                c = req.num_computed
                pos = np.arange(c)
                table = np.asarray(req.block_ids[gid][: -(-c // bs)], dtype=np.int64)
                blocks.append(table[pos // bs])
                rows.append(pos % bs)
                headers.append(req.chain.headers(c))
                bounds.append(bounds[-1] + c)
            b_idx, r_idx = np.concatenate(blocks), np.concatenate(rows)
            expected = np.concatenate(headers).view(np.uint8).reshape(-1, HEADER_BYTES)
            for layer in self.layers_by_group[gid]:
                actual = layer.pages.reshape(layer.pages.shape[0], bs, -1)[b_idx, r_idx]
                bad = (actual[:, :TAG_AT] != expected[:, :TAG_AT]).any(axis=1)
                bad |= (actual[:, TAG_AT:HEADER_BYTES] != self._tag(layer)).any(axis=1)
                bad |= actual[:, HEADER_BYTES:].any(axis=1)
                if bad.any():
                    first = int(np.flatnonzero(bad)[0])
                    i = int(np.searchsorted(bounds, first, side="right")) - 1
                    self._attention_mismatch(
                        int(b_idx[first]),
                        reqs[i],
                        layer,
                        first - bounds[i],
                        actual[first],
                        bad[bounds[i] : bounds[i + 1]],
                    )
                self.counters.rows_checked += len(b_idx)
        for gid in self.mamba_groups:
            cols = [req.block_ids[gid][req.mamba_state_idx] for _, req in reqs]
            states = np.stack([self._state_bytes(req.chain, req.num_computed) for _, req in reqs])
            for layer in self.layers_by_group[gid]:
                actual = layer.pages[np.asarray(cols, dtype=np.int64)]
                bad = (actual[:, :TAG_AT] != states[:, :TAG_AT]).any(axis=1)
                bad |= (actual[:, TAG_AT:HEADER_BYTES] != self._tag(layer)).any(axis=1)
                bad |= actual[:, HEADER_BYTES:].any(axis=1)
                if bad.any():
                    i = int(np.flatnonzero(bad)[0])
                    self._mamba_mismatch(reqs[i], layer, cols[i], actual[i])
                self.counters.states_checked += len(cols)

    def _tag(self, layer: _Layer) -> np.ndarray:
        """The layer/rank bytes of every header this rank writes for ``layer``."""
        return np.array([layer.index, self.rank], dtype="<u2").view(np.uint8)

    def _state_bytes(self, chain: TokenChain, num_tokens: int) -> np.ndarray:
        """Mamba state header after ``num_tokens`` with layer/rank 0, padded with zeros."""
        return self.model.mamba_state(chain, num_tokens, 0, 0)

    def _attention_mismatch(
        self,
        block: int,
        item: tuple[str, _Req],
        layer: _Layer,
        t: int,
        found: np.ndarray,
        bad: np.ndarray,
    ) -> None:
        req_id, req = item
        model, bs = self.model, self.block_size
        want = model.attention_rows(req.chain, t, t + 1, layer.index, self.rank)[0]
        raise CacheMismatch(
            f"rank {self.rank} step {self.counters.steps}: request {req_id!r} reads attention "
            f"layer {layer.name} block {block} (block index {t // bs}, {int(bad.sum())} bad "
            f"rows), first bad token {t}: expected prefix of {t + 1} tokens "
            f"[{model.describe(want)}], found [{model.describe(found)}]"
        )

    def _mamba_mismatch(
        self, item: tuple[str, _Req], layer: _Layer, block: int, found: np.ndarray
    ) -> None:
        req_id, req = item
        model = self.model
        want = model.mamba_state(req.chain, req.num_computed, layer.index, self.rank)
        raise CacheMismatch(
            f"rank {self.rank} step {self.counters.steps}: request {req_id!r} starts from "
            f"Mamba state in layer {layer.name} block {block} (column {req.mamba_state_idx}): "
            f"expected state after {req.num_computed} tokens "
            f"[{model.describe(want, state=True)}], found [{model.describe(found, state=True)}]"
        )

    # -- forward -------------------------------------------------------------------------
    def _forward_step(self, so: SchedulerOutput) -> dict[str, list[int]]:
        """Write this step's attention rows and end-of-step Mamba states, then 'sample'."""
        bs = self.block_size
        items = []
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.requests[req_id]
            stop = req.num_computed + n
            assert stop <= len(req.chain.tokens), (
                f"{req_id}: scheduled up to token {stop}, only {len(req.chain.tokens)} known"
            )
            items.append((req_id, req, req.num_computed, stop))
        if self.write:
            for gid in self.attn_groups:
                blocks, rows, headers = [], [], []
                for _, req, start, stop in items:
                    pos = np.arange(start, stop)
                    blocks.append(np.asarray(req.block_ids[gid], dtype=np.int64)[pos // bs])
                    rows.append(pos % bs)
                    headers.append(req.chain.headers(stop)[start:stop])
                b_idx, r_idx = np.concatenate(blocks), np.concatenate(rows)
                values = np.concatenate(headers).view(np.uint8).reshape(-1, HEADER_BYTES)
                for layer in self.layers_by_group[gid]:
                    pages = layer.pages.reshape(layer.pages.shape[0], bs, -1)
                    pages[b_idx, r_idx, :HEADER_BYTES] = values
                    pages[b_idx, r_idx, TAG_AT:HEADER_BYTES] = self._tag(layer)
                    pages[b_idx, r_idx, HEADER_BYTES:] = 0
            for gid in self.mamba_groups:
                cols = np.asarray(
                    [req.block_ids[gid][req.mamba_state_idx] for _, req, _, _ in items],
                    dtype=np.int64,
                )
                states = np.stack([self._state_bytes(req.chain, stop) for _, req, _, stop in items])
                for layer in self.layers_by_group[gid]:
                    layer.pages[cols] = states
                    layer.pages[cols, TAG_AT:HEADER_BYTES] = self._tag(layer)
            for req_id, req, _, stop in items:
                self.model.remember(req_id, req.chain, stop)
        sampled: dict[str, list[int]] = {}
        for req_id, req, _, stop in items:
            if stop < len(req.chain.tokens):
                sampled[req_id] = []  # a prefill chunk: vLLM discards what it would sample
                continue
            token = self.model.next_token(req.chain, VOCAB_SIZE)
            req.chain.append([token])
            sampled[req_id] = [token]
        return sampled


def _layer_number(name: str) -> int:
    parts = [p for p in name.split(".") if p.isdigit()]
    return int(parts[0]) if parts else 0

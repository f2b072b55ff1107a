"""One simulated engine: vLLM's real scheduler, real connectors, stand-in model runners.

The step loop mirrors ``EngineCore.step`` (sync) and ``EngineCore.step_with_batch_queue``
(async scheduling, two batches in flight). Each rank gets its own unpickled copy of the
connector metadata, as vLLM's executor ships it; rank outputs are merged by vLLM's real
``KVOutputAggregator``. Faults on worker outputs are applied per rank before merging.
"""

from __future__ import annotations

import os
import pickle
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine import FinishReason
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import RequestStatus

from himamba.connector.vllm_fixups.runner_v2_hook import ENV as STEP_HOOK_ENV

from .faults import worker_rank_as
from .prefix_bytes import PrefixModel, salt_seed
from .runner import StandInRunner
from .vllm_setup import (
    EngineSpec,
    allocate_worker_caches,
    make_request,
    make_scheduler,
    make_vllm_config,
    resolve_kv_cache,
)

OutputFault = Callable[[int, int, KVConnectorOutput], KVConnectorOutput]


@contextmanager
def model_runner_v2(vllm_config: Any, spec: EngineSpec) -> Iterator[None]:
    """Connectors built inside see vLLM's ``use_v2_model_runner`` as ``spec`` says: vLLM's own
    environment switch, set only while they read it (the CPU build refuses to start an engine
    with it, since V2 needs Triton; the stand-in runner follows V2's call order instead), and
    himamba's switch for its V2 step-start hook."""
    if not spec.model_runner_v2:
        yield
        return
    env = {"VLLM_USE_V2_MODEL_RUNNER": "1", STEP_HOOK_ENV: "1" if spec.v2_step_hook else "0"}
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        # vLLM caches its environment once an engine has started in this process.
        assert vllm_config.use_v2_model_runner, "vllm.envs is cached: cannot switch runners"
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class RequestRecord:
    prompt: list[int]
    cache_salt: str | None
    output: list[int] = field(default_factory=list)
    finish: FinishReason | None = None


@dataclass
class HitCounts:
    """Tokens served per tier, as vLLM's own prefix-cache stats report them."""

    local_hits: int = 0  # vLLM's GPU prefix cache
    external_hits: int = 0  # connector, all tiers
    queries: int = 0
    by_source: dict[str, int] = field(default_factory=dict)

    @property
    def host(self) -> int:
        return self.by_source.get(CacheHitSource.HOST.value, 0)

    @property
    def storage(self) -> int:
        return self.by_source.get(CacheHitSource.DISK.value, 0)


class LifecycleEngine:
    def __init__(
        self,
        spec: EngineSpec,
        model_config: Any,
        *,
        verify: bool = True,
        describe: bool = True,
        write: bool = True,
        idle_sleep_s: float = 0.001,
    ) -> None:
        self.spec = spec
        self.idle_sleep_s = idle_sleep_s
        self.vllm_config = make_vllm_config(spec, model_config)
        self.kv = resolve_kv_cache(spec, self.vllm_config)
        with model_runner_v2(self.vllm_config, spec):
            self.scheduler = make_scheduler(self.vllm_config, self.kv)
        self.connector = self.scheduler.connector
        assert (self.connector is not None) == spec.with_connector
        world = spec.tensor_parallel_size
        attn_page = next(
            g.kv_cache_spec.page_size_bytes
            for g in self.kv.scheduler_config.kv_cache_groups
            if not hasattr(g.kv_cache_spec, "mamba_cache_mode")
        )
        mamba_bytes = next(
            g.kv_cache_spec.real_page_size_bytes
            for g in self.kv.scheduler_config.kv_cache_groups
            if hasattr(g.kv_cache_spec, "mamba_cache_mode")
        )
        self.model = PrefixModel(
            block_size=self.kv.block_size,
            attn_row_bytes=attn_page // self.kv.block_size,
            mamba_state_bytes=mamba_bytes,
            registry={} if describe else None,
        )
        with model_runner_v2(self.vllm_config, spec):
            self.runners = [
                self._make_runner(rank, self.kv.worker_configs[rank], verify, write)
                for rank in range(world)
            ]
        self.aggregator = (
            KVOutputAggregator.from_connector(self.connector, world)
            if self.connector is not None
            else None
        )
        self.output_faults: list[OutputFault] = []
        self.records: dict[str, RequestRecord] = {}
        self.hits = HitCounts()
        self.steps = 0
        self._queue: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        self._closed = False
        # What the scheduler connector answered each request, recorded on the way through
        # (like vLLM's own call-recording test connector); answers are never altered.
        self.lookups: dict[str, list[tuple[int | None, bool]]] = defaultdict(list)
        if self.connector is not None:
            self._record_lookups(self.connector)

    def _record_lookups(self, connector: Any) -> None:
        real_lookup = connector.get_num_new_matched_tokens

        def recorded_lookup(request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
            answer = real_lookup(request, num_computed_tokens)
            self.lookups[request.request_id].append(answer)
            return answer

        connector.get_num_new_matched_tokens = recorded_lookup

    def _make_runner(
        self, rank: int, kv_cache_config: Any, verify: bool, write: bool
    ) -> StandInRunner:
        """Built as vLLM's worker builds its connector: the factory, then register_kv_caches."""
        if not self.spec.with_connector:
            caches = allocate_worker_caches(kv_cache_config)
            return StandInRunner(rank, kv_cache_config, None, caches, self.model,
                                 self.spec.async_scheduling, verify, write)  # fmt: skip
        with worker_rank_as(rank):
            conn = KVConnectorFactory.create_connector(
                config=self.vllm_config,
                role=KVConnectorRole.WORKER,
                kv_cache_config=kv_cache_config,
            )
            caches = allocate_worker_caches(kv_cache_config)
            conn.register_kv_caches(caches)
        return StandInRunner(
            rank=rank,
            kv_cache_config=kv_cache_config,
            connector=conn,
            kv_caches=caches,
            model=self.model,
            async_scheduling=self.spec.async_scheduling,
            model_runner_v2=self.spec.model_runner_v2,
            verify=verify,
            write=write,
        )

    # -- requests ----------------------------------------------------------------------
    def add_request(
        self,
        req_id: str,
        prompt: list[int],
        max_tokens: int = 2,
        cache_salt: str | None = None,
    ) -> None:
        request = make_request(req_id, prompt, max_tokens, self.kv.hash_block_size, cache_salt)
        self.records[req_id] = RequestRecord(list(prompt), cache_salt)
        seed = salt_seed(cache_salt, self.model.epoch)
        for runner in self.runners:
            runner.seeds[req_id] = seed
        self.scheduler.add_request(request)

    def abort(self, req_ids: Iterable[str]) -> None:
        ids = list(req_ids)
        for req in self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED):
            self.records[req.request_id].finish = FinishReason.ABORT
        for runner in self.runners:
            for rid in ids:
                runner.seeds.pop(rid, None)

    def status(self, req_id: str) -> RequestStatus | None:
        req = self.scheduler.requests.get(req_id)
        return None if req is None else req.status

    def reset_prefix_cache(self, new_epoch: bool = True) -> bool:
        """vLLM's reset with the connector; by default also a new model epoch: requests that
        arrive after it compute different bytes (as after a weight update), so any byte
        cached before the reset and served to them fails CHECK."""
        ok = self.scheduler.reset_prefix_cache(reset_connector=True)
        if new_epoch:
            self.model.epoch += 1
        return ok

    # -- the three phases of a step ----------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        return self.scheduler.schedule()

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run every rank on the step, then merge with vLLM's aggregator."""
        self.steps += 1
        if self.aggregator is None:
            return self.runners[0].execute(so, None)
        blob = pickle.dumps(so.kv_connector_metadata)
        outputs = []
        for runner in self.runners:
            out = runner.execute(so, pickle.loads(blob))
            kv_out = out.kv_connector_output
            assert kv_out is not None
            if kv_out.kv_connector_worker_meta is not None:
                kv_out.kv_connector_worker_meta = pickle.loads(
                    pickle.dumps(kv_out.kv_connector_worker_meta)
                )
            for fault in self.output_faults:
                kv_out = fault(runner.rank, self.steps, kv_out)
            out.kv_connector_output = kv_out
            outputs.append(out)
        merged = self.aggregator.aggregate(outputs, 0)
        assert merged is not None
        return merged

    def update(self, so: SchedulerOutput, mro: ModelRunnerOutput) -> None:
        engine_outputs = self.scheduler.update_from_output(so, mro)
        for eco in engine_outputs.values():
            for out in eco.outputs:
                rec = self.records[out.request_id]
                rec.output.extend(out.new_token_ids)
                if out.finish_reason is not None:
                    rec.finish = out.finish_reason
            if eco.scheduler_stats is not None:
                self._absorb(eco.scheduler_stats)

    def _absorb(self, stats: Any) -> None:
        if stats.prefix_cache_stats is not None:
            self.hits.local_hits += stats.prefix_cache_stats.hits
        cps = stats.connector_prefix_cache_stats
        if cps is not None:
            self.hits.external_hits += cps.hits
            self.hits.queries += cps.queries
            for source, n in cps.hits_by_source.items():
                key = getattr(source, "value", str(source))
                self.hits.by_source[key] = self.hits.by_source.get(key, 0) + n

    # -- stepping ----------------------------------------------------------------------
    def step(self) -> bool:
        """One EngineCore step; False when there was nothing to do."""
        if self.spec.async_scheduling:
            return self._step_with_batch_queue()
        if not self.scheduler.has_requests():
            return False
        so = self.schedule()
        self.update(so, self.execute(so))
        self._yield_if_idle(so)
        return True

    def _yield_if_idle(self, so: SchedulerOutput) -> None:
        """A step that scheduled nothing is waiting on connector I/O. In vLLM the storage
        threads that must finish it live in other processes; here they share this process's
        GIL with the spinning step loop, so hand it over briefly (timing only, no semantics)."""
        if not so.total_num_scheduled_tokens and self.idle_sleep_s:
            time.sleep(self.idle_sleep_s)

    def _step_with_batch_queue(self) -> bool:
        queue = self._queue
        if self.scheduler.has_requests():
            so = self.schedule()
            mro = self.execute(so)
            queue.appendleft((so, mro))
            self._yield_if_idle(so)
            executed = so.total_num_scheduled_tokens > 0
            if len(queue) < 2 and (executed or self.scheduler.has_requests()):
                return True
        elif not queue:
            return False
        so, mro = queue.pop()
        self.update(so, mro)
        return True

    def flush_queue(self) -> None:
        """Process every in-flight batch (async scheduling), e.g. before a reset."""
        while self._queue:
            so, mro = self._queue.pop()
            self.update(so, mro)

    def run_until(
        self, done: Callable[[], bool], max_steps: int = 10_000, timeout_s: float = 60.0
    ) -> None:
        deadline = time.monotonic() + timeout_s
        for _ in range(max_steps):
            if done():
                return
            if not self.step():
                if done():
                    return
                time.sleep(0.001)
            if time.monotonic() > deadline:
                break
        raise AssertionError(f"engine did not reach the expected state: {self.describe_state()}")

    def run_until_idle(self, max_steps: int = 100_000, timeout_s: float = 120.0) -> None:
        self.run_until(lambda: not self.scheduler.has_requests() and not self._queue,
                       max_steps, timeout_s)  # fmt: skip

    def idle_steps(self, n: int) -> None:
        """Empty engine steps (what any later request would trigger): connectors poll,
        acknowledgements travel, nothing is scheduled."""
        for _ in range(n):
            so = self.schedule()
            self.update(so, self.execute(so))

    def describe_state(self) -> str:
        reqs = {rid: r.status.name for rid, r in self.scheduler.requests.items()}
        return f"step {self.steps}, scheduler requests {reqs}, queue {len(self._queue)}"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for runner in self.runners:
            if runner.connector is not None:
                runner.connector.shutdown()
        if self.connector is not None:
            self.connector.shutdown()

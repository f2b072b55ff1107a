"""Counts the steps an in-process engine takes to compute a prompt.

Why: whether vLLM prefills a prompt in one step or stops at a block boundary first is
how a Mamba checkpoint export shows in a schedule (tests and a benchmark read it)."""

from __future__ import annotations

from typing import Any


def record_prefill_chunks(llm: Any) -> list[int]:
    """Wrap the scheduler of ``llm`` (in-process engine core) so that every step that
    schedules more than one token appends its token count to the returned list; callers
    clear the list between prompts."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    schedule = scheduler.schedule
    chunks: list[int] = []

    def counting_schedule(*args: Any, **kwargs: Any) -> Any:
        out = schedule(*args, **kwargs)
        if out.total_num_scheduled_tokens > 1:
            chunks.append(out.total_num_scheduled_tokens)
        return out

    scheduler.schedule = counting_schedule
    return chunks

"""Which Mamba states a request leaves in the CPU tier, and which of them replace which.

With dense retention vLLM hands a connector a state at every block boundary a request crosses
(prefill chunk ends, and every block of its output). Storing all of them would fill the Mamba
pool with states nobody reuses, evicting the few that matter. Per request we keep:

- the prompt end (vLLM's replay boundary): the same prompt again, or a next turn that only
  shares the prompt, hits here;
- the junction: where the request left every path the tree had seen, i.e. the end of the part
  it shares with earlier requests (a common system prompt), where the next sharer hits;
- a checkpoint every ``interval`` tokens: a prompt that shares only the first part of this one
  (same document, another question) hits at the last checkpoint before they diverge;
- its latest decode boundary, each one replacing the previous (unless that one is also one of
  the above): the conversation's next turn hits through this turn's output.

For a 4,000-token prompt that generates 4,000 tokens with a 1,024-token interval that is at most
prompt end + junction + 7 checkpoints + 1 decode state, instead of one per block
(~62 at a 128-token block).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestStates:
    """What the budget remembers of one request (boundaries in tokens)."""

    prompt_end: int
    junction: int
    last_decode: int = 0


class StateBudget:
    def __init__(self, block_size: int, interval_tokens: int) -> None:
        self.block_size = block_size
        # Checkpoints must sit on block boundaries: round up to whole blocks.
        self.interval = -(-interval_tokens // block_size) * block_size

    def open(self, num_prompt_tokens: int, known_blocks: int) -> RequestStates:
        """Start a request's book; ``known_blocks``: leading blocks the tree already knew."""
        bs = self.block_size
        prompt_end = (num_prompt_tokens - 1) // bs * bs
        junction = known_blocks * bs if 0 < known_blocks * bs < prompt_end else 0
        return RequestStates(prompt_end, junction)

    def _lasting(self, book: RequestStates, boundary: int) -> bool:
        return boundary in (book.prompt_end, book.junction) or boundary % self.interval == 0

    def decide(self, book: RequestStates, boundary: int) -> tuple[bool, int]:
        """(store the state at ``boundary``, an earlier boundary of this request whose state it
        replaces, or 0). Decode boundaries are the ones past the prompt end. Changes nothing:
        call ``stored`` once the state really is stored."""
        lasting = self._lasting(book, boundary)
        if boundary <= book.prompt_end:
            return lasting, 0
        if boundary <= book.last_decode:
            # A replay after preemption crosses boundaries it already handled: their states
            # were stored (or replaced) the first time.
            return False, 0
        previous = book.last_decode
        if previous and not self._lasting(book, previous):
            return True, previous
        return True, 0

    def stored(self, book: RequestStates, boundary: int) -> None:
        """The state at ``boundary`` was stored: it is the request's latest decode state."""
        if boundary > book.prompt_end:
            book.last_decode = max(book.last_decode, boundary)

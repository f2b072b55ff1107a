"""Which kept tail a lookup's tokens continue (``scheduler.tails.TailIndex``).

A wrong answer here is a hit on bytes computed for other tokens, so every way a tail can fail
to match is tried: other tokens, a tail too long for the prompt (its last token is always
recomputed), another partition, another parent, a parent before the part vLLM already holds.
"""

from __future__ import annotations

import hashlib

from himamba.connector.scheduler.tails import TailHit, TailIndex, tail_candidates, tail_hash

BS = 4


def chain(tokens: list[int]) -> list[bytes]:
    """One chained hash per full block of ``tokens`` (like vLLM's block hashes)."""
    out, h = [], b"root"
    for i in range(len(tokens) // BS):
        h = hashlib.sha256(h + bytes(tokens[i * BS : (i + 1) * BS])).digest()
        out.append(h)
    return out


def kept(index: TailIndex, tokens: list[int], computed: int, part: object = None) -> bytes:
    """What ``PartialTails.keep`` records for a request that computed ``computed`` tokens."""
    p, length = divmod(computed, BS)
    hashes = chain(tokens)
    tail = tail_hash(hashes[p - 1], tokens[p * BS : computed])
    index.add(part, hashes[p - 1], tail, length)
    return tail


def best(index: TailIndex, tokens: list[int], first: int = 0, part: object = None):
    return index.best(part, chain(tokens), tokens, BS, first, len(tokens) - 1)


def test_a_request_continuing_the_tokens_hits_the_tail() -> None:
    index = TailIndex()
    prev = list(range(1, 12))  # 11 tokens: 2 full blocks and 3 more
    tail = kept(index, prev, 11)
    nxt = prev + [50, 51, 52]
    assert best(index, nxt) == TailHit(2, 3, tail)


def test_other_tokens_after_the_parent_miss() -> None:
    index = TailIndex()
    prev = list(range(1, 12))
    kept(index, prev, 11)
    nxt = prev[:10] + [99] + [50, 51, 52]  # the tail's last token differs
    assert best(index, nxt) is None


def test_a_tail_reaching_the_last_prompt_token_is_not_hit() -> None:
    index = TailIndex()
    prev = list(range(1, 12))
    kept(index, prev, 11)
    assert best(index, prev) is None  # the same 11 tokens: token 11 must be recomputed
    assert best(index, prev + [50]) == TailHit(2, 3, best(index, prev + [50]).tail)


def test_partitions_and_parents_do_not_mix() -> None:
    index = TailIndex()
    prev = list(range(1, 12))
    kept(index, prev, 11, part="salt-a")
    nxt = prev + [50, 51]
    assert best(index, nxt, part="salt-b") is None
    assert best(index, nxt, part="salt-a") is not None
    other = [7] + prev[1:] + [50, 51]  # the first block differs: another parent chain
    assert best(index, other, part="salt-a") is None


def test_the_deepest_and_longest_tail_wins_and_none_before_first() -> None:
    index = TailIndex()
    prev = list(range(1, 20))
    kept(index, prev, 9)  # parent block 2, 1 token
    kept(index, prev, 10)  # parent block 2, 2 tokens
    deep = kept(index, prev, 14)  # parent block 3, 2 tokens
    nxt = prev + [60]
    assert best(index, nxt) == TailHit(3, 2, deep)
    assert best(index, nxt, first=4) is None  # vLLM already holds 4 blocks: nothing deeper
    short = prev[:12] + [61, 62]
    got = best(index, short)
    assert (got.parent_blocks, got.length) == (2, 2)


def test_the_oldest_parents_are_forgotten_past_the_limit() -> None:
    index = TailIndex(max_parents=2)
    prompts = [[i] * 6 for i in range(1, 4)]
    for p in prompts:
        kept(index, p, 5)
    assert len(index) == 2
    assert best(index, prompts[0] + [9]) is None
    assert best(index, prompts[2] + [9]) is not None


def test_candidates_name_every_prefix_as_tail_hash_does() -> None:
    parent, tokens = b"p" * 32, [5, -1, 2**40, 0, 7]
    assert tail_candidates(parent, tokens) == [
        tail_hash(parent, tokens[:n]) for n in range(1, len(tokens) + 1)
    ]
    assert len(set(tail_candidates(parent, tokens))) == len(tokens)

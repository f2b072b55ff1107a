"""The bytes the stand-in model writes, so that any stale or misplaced byte is detectable.

Real KV of token t depends on every token before it; a Mamba state at P summarises exactly
``tokens[:P]``. The stand-in keeps both properties with digests instead of math:

- ``chain[k]`` is a 64-bit digest of ``seed || tokens[:k*bs]`` (seed = the request's cache
  salt, so a cross-salt hit is a wrong byte, not merely a policy violation);
- attention row (token t, layer l, rank r) = header(chain[t // bs], token t, t, l, r) + zeros:
  the rows of a block jointly fix every token of its prefix;
- Mamba state at P (layer l, rank r) = header(state_digest(P), 0, P, l, r) + zeros.

Layer and rank are in every header, so bytes copied to the wrong layer or the wrong TP rank
fail the check as surely as bytes of the wrong prefix.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

HEADER = np.dtype(
    [("digest", "<u8"), ("token", "<u4"), ("pos", "<u4"), ("layer", "<u2"), ("rank", "<u2")]
)
HEADER_BYTES = HEADER.itemsize  # 20
TAG_AT = HEADER.fields["layer"][1]  # layer and rank: the header's last 4 bytes


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def salt_seed(cache_salt: str | None, epoch: int = 0) -> int:
    """Where a request's digest chain starts: its cache salt, and the model "epoch" (bumped
    by a connector reset, standing for a weight update: bytes from before it are stale)."""
    return _digest(f"himamba-lifecycle-seed|{epoch}|".encode() + (cache_salt or "").encode())


class CacheMismatch(AssertionError):
    """A block a step is about to read does not hold the bytes of the request's prefix."""


@dataclass
class TokenChain:
    """One request's tokens, the digests of its block-aligned prefixes, and the attention
    row headers of every known token (built incrementally: CHECK reads them every step)."""

    block_size: int
    seed: int
    tokens: list[int] = field(default_factory=list)
    _chain: list[int] = field(default_factory=list)
    _headers: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=HEADER))
    _num_headers: int = 0

    def __post_init__(self) -> None:
        self._chain = [self.seed]

    def append(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def truncate(self, num_tokens: int) -> None:
        del self.tokens[num_tokens:]
        del self._chain[num_tokens // self.block_size + 1 :]
        self._num_headers = min(self._num_headers, num_tokens)

    def chain(self, num_blocks: int) -> list[int]:
        """Digests of the prefixes of 0..num_blocks full blocks (num_blocks + 1 entries)."""
        bs = self.block_size
        while len(self._chain) <= num_blocks:
            k = len(self._chain) - 1
            block = np.asarray(self.tokens[k * bs : (k + 1) * bs], dtype="<u4")
            assert block.size == bs, "digest of a block whose tokens are not known yet"
            self._chain.append(_digest(self._chain[k].to_bytes(8, "little") + block.tobytes()))
        return self._chain

    def headers(self, stop: int) -> np.ndarray:
        """Row headers (layer and rank left 0) of tokens [0, stop)."""
        done = self._num_headers
        if stop > done:
            if stop > self._headers.size:
                grown = np.zeros(max(stop, 2 * self._headers.size), dtype=HEADER)
                grown[:done] = self._headers[:done]
                self._headers = grown
            bs = self.block_size
            digests = np.asarray(self.chain((stop - 1) // bs), dtype="<u8")
            pos = np.arange(done, stop, dtype="<u4")
            part = self._headers[done:stop]
            part["digest"] = digests[pos // bs]
            part["token"] = np.asarray(self.tokens[done:stop], dtype="<u4")
            part["pos"] = pos
            self._num_headers = stop
        return self._headers[:stop]

    def state_digest(self, num_tokens: int) -> int:
        """Digest of exactly ``tokens[:num_tokens]`` (what a Mamba state at that point means)."""
        bs = self.block_size
        full = num_tokens // bs
        base = self.chain(full)[full]
        tail = np.asarray(self.tokens[full * bs : num_tokens], dtype="<u4").tobytes()
        return _digest(base.to_bytes(8, "little") + tail + b"|state")


@dataclass
class PrefixModel:
    """Expected bytes for attention rows and Mamba states, plus decoding for messages."""

    block_size: int
    attn_row_bytes: int
    mamba_state_bytes: int
    # digest -> (request id, prefix length), only when asked for (the soak skips it).
    registry: dict[int, tuple[str, int]] | None = None
    # Requests that arrive after a reset compute "new weights" bytes.
    epoch: int = 0

    def attention_headers(
        self, chain: TokenChain, start: int, stop: int, layer: int, rank: int
    ) -> np.ndarray:
        """Header bytes of the rows of tokens [start, stop): uint8 ``[n, HEADER_BYTES]``.
        The rest of every row is zero."""
        hdr = chain.headers(stop)[start:stop].copy()
        hdr["layer"] = layer
        hdr["rank"] = rank
        return hdr.view(np.uint8).reshape(stop - start, HEADER_BYTES)

    def attention_rows(
        self, chain: TokenChain, start: int, stop: int, layer: int, rank: int
    ) -> np.ndarray:
        """Full rows for tokens [start, stop) as uint8 ``[stop - start, attn_row_bytes]``."""
        rows = np.zeros((stop - start, self.attn_row_bytes), dtype=np.uint8)
        rows[:, :HEADER_BYTES] = self.attention_headers(chain, start, stop, layer, rank)
        return rows

    def mamba_state(self, chain: TokenChain, num_tokens: int, layer: int, rank: int) -> np.ndarray:
        hdr = np.zeros(1, dtype=HEADER)
        hdr["digest"] = chain.state_digest(num_tokens)
        hdr["pos"] = num_tokens
        hdr["layer"] = layer
        hdr["rank"] = rank
        out = np.zeros(self.mamba_state_bytes, dtype=np.uint8)
        out[:HEADER_BYTES] = hdr.view(np.uint8)
        return out

    def remember(self, req_id: str, chain: TokenChain, upto: int) -> None:
        """Record digests of this request's prefixes so a mismatch can name whose bytes it saw."""
        if self.registry is None:
            return
        bs = self.block_size
        for k, d in enumerate(chain.chain(upto // bs)):
            self.registry.setdefault(d, (req_id, k * bs))
        self.registry.setdefault(chain.state_digest(upto), (req_id, upto))

    def describe(self, raw: np.ndarray, state: bool = False) -> str:
        """Human-readable content of one attention row (or, with ``state``, a Mamba state)."""
        if not raw.any():
            return "all zeros (never written, or zeroed by vLLM)"
        hdr = np.frombuffer(raw[:HEADER_BYTES].tobytes(), dtype=HEADER)[0]
        d, pos = int(hdr["digest"]), int(hdr["pos"])
        whose = ""
        if self.registry is not None and d in self.registry:
            rid, n = self.registry[d]
            whose = f" (= first {n} tokens of request {rid!r})"
        what = (
            f"state after {pos} tokens, digest {d:016x}{whose}"
            if state
            else f"token {int(hdr['token'])} at position {pos} after prefix {d:016x}{whose}"
        )
        extra = "" if not raw[HEADER_BYTES:].any() else ", plus non-zero trailing bytes"
        return f"{what}, layer {int(hdr['layer'])}, rank {int(hdr['rank'])}{extra}"

    def next_token(self, chain: TokenChain, vocab_size: int) -> int:
        """Greedy 'sampling': a function of the whole prefix, like a real model's argmax."""
        return chain.state_digest(len(chain.tokens)) % vocab_size

"""An optional native helper for the CPU tier's row copies, built on first use.

The numpy path (``host_copy.copy_rows``) copies each row with memcpy, which writes rows of a
few dozen KiB through the cache: every destination line is read first, so a random batch moves
at ~0.7x of one plain memcpy of the same bytes. ``row_copy.c`` writes with streaming stores
instead (~1.0x on the same machine). It is compiled once per machine with the system C
compiler (``$CC``, else ``cc``) into a cache directory and loaded with ctypes, whose calls
release the GIL. Without a compiler, off x86-64, with ``HIMAMBA_NATIVE_COPY=0``, or if the
build or its self-test fails, nothing changes: the numpy path runs (logged once).

The helper trusts its addresses, so every row is checked here against the arrays it belongs
to before the call; what reaches C is only ranges inside those arrays.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from himamba.tiers.host_copy import Runs
    from himamba.tiers.transfer import SegmentRuns

log = logging.getLogger(__name__)

ENV_SWITCH = "HIMAMBA_NATIVE_COPY"  # "0": never build or use the helper
ENV_DIR = "HIMAMBA_NATIVE_DIR"  # where the built library is cached
SOURCE = Path(__file__).with_name("row_copy.c")
BUILD_TIMEOUT_S = 120
# Batches smaller than this stay on the numpy path: their rows fit in the last-level cache,
# where ordinary stores beat streaming ones (10 MB: numpy 1.0x of memcpy, streaming 0.5-0.7x).
# Three quarters of the L3, as glibc's own memcpy decides; 24 MiB when sysfs does not say.
DEFAULT_STREAM_MIN_BYTES = 24 << 20
_STREAMING_MACHINES = ("x86_64", "amd64")


def cache_dir() -> Path:
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "himamba" / "native"


def _build(src: Path, out: Path) -> None:
    """Compile ``src`` into ``out`` atomically (ranks of one engine may build at once)."""
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise FileNotFoundError(f"no C compiler ({cc!r}; set CC)")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cc, "-O2", "-shared", "-fPIC", "-o", tmp, str(src)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr.strip()[-500:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _l3_bytes(path: str = "/sys/devices/system/cpu/cpu0/cache/index3/size") -> int | None:
    try:
        text = Path(path).read_text().strip().upper()
    except OSError:
        return None
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    digits = text.rstrip("KMG")
    return int(digits) * scale if digits.isdigit() else None


@lru_cache(maxsize=1)
def stream_min_bytes() -> int:
    """The smallest batch (bytes) worth streaming on this machine."""
    l3 = _l3_bytes()
    return DEFAULT_STREAM_MIN_BYTES if not l3 else l3 * 3 // 4


class NativeRowCopy:
    """``himamba_copy_rows`` from a built library, checked on a known batch when loaded."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        fn = lib.himamba_copy_rows
        fn.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_uint64,
            ctypes.c_int,
        ]
        fn.restype = ctypes.c_uint64
        self._fn = fn
        self.path = path
        self.isa = 0  # the best the CPU has; tests set 1 (SSE2) to check the other path
        for isa in (1, 0):
            self.isa = isa
            self._self_test()

    def _self_test(self) -> None:
        rng = np.random.default_rng(0)
        src = rng.integers(0, 256, size=(8, 9000), dtype=np.uint8)
        dst = np.zeros((8, 9001), dtype=np.uint8)
        order = np.array([5, 0, 7, 2], dtype=np.int64)
        self.rows(src, dst[:, 1:], order, order[::-1].copy())
        if not np.array_equal(dst[order[::-1], 1:], src[order]) or dst[:, 0].any():
            raise RuntimeError("self-test copied wrong bytes")

    def rows(
        self, src: np.ndarray, dst: np.ndarray, src_rows: np.ndarray, dst_rows: np.ndarray
    ) -> None:
        """``dst[dst_rows[i]] = src[src_rows[i]]`` for 2-D uint8 arrays with byte-contiguous rows."""
        s, d, n = row_ranges(src, dst, src_rows, dst_rows)
        self.call(s, d, n)

    def call(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
        """Raw batch: uint64 address and size arrays, already checked (``row_ranges``)."""
        rows = len(src)
        if not (len(dst) == len(nbytes) == rows):
            raise ValueError("address arrays differ in length")
        if rows:
            self._fn(src.ctypes.data, dst.ctypes.data, nbytes.ctypes.data, rows, self.isa)

    def copy_segments(self, segments: Sequence[SegmentRuns], to_host: bool) -> None:
        """A plan's segments (all with numpy views of the cache) in one call."""
        per_runs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        srcs, dsts, sizes = [], [], []
        for g in segments:
            assert g.np_seg is not None
            rows = per_runs.get(id(g.runs))
            if rows is None:
                rows = per_runs[id(g.runs)] = run_rows(g.runs)
            blocks, slots = rows
            if to_host:
                s, d, n = row_ranges(g.np_seg, g.np_host, blocks, slots)
            else:
                s, d, n = row_ranges(g.np_host, g.np_seg, slots, blocks)
            srcs.append(s)
            dsts.append(d)
            sizes.append(n)
        if srcs:
            self.call(np.concatenate(srcs), np.concatenate(dsts), np.concatenate(sizes))


def run_rows(runs: Runs) -> tuple[np.ndarray, np.ndarray]:
    """The (block, slot) of every row the runs move, as int64 arrays, in run order."""
    if not runs.runs:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    arr = np.asarray(runs.runs, dtype=np.int64)
    if runs.singles:
        return arr[:, 0].copy(), arr[:, 1].copy()
    counts = arr[:, 2]
    offsets = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(
        np.cumsum(counts) - counts, counts
    )
    return np.repeat(arr[:, 0], counts) + offsets, np.repeat(arr[:, 1], counts) + offsets


def row_ranges(
    src: np.ndarray, dst: np.ndarray, src_rows: np.ndarray, dst_rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """uint64 (source address, destination address, size) per row, after checking that every
    row index is inside its array and that both sides are 2-D byte arrays of one row width."""
    for name, a, idx in (("source", src, src_rows), ("destination", dst, dst_rows)):
        if a.ndim != 2 or a.dtype != np.uint8 or (a.shape[1] > 1 and a.strides[1] != 1):
            raise ValueError(
                f"{name}: rows must be byte-contiguous uint8 (got {a.dtype}, {a.strides})"
            )
        if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= a.shape[0]):
            raise IndexError(f"{name} row out of range 0..{a.shape[0] - 1}")
    if src.shape[1] != dst.shape[1]:
        raise ValueError(f"row widths differ: {src.shape[1]} vs {dst.shape[1]}")
    if len(src_rows) != len(dst_rows):
        raise ValueError(f"{len(src_rows)} source rows for {len(dst_rows)} destination rows")
    s = (src.ctypes.data + src_rows * src.strides[0]).astype(np.uint64)
    d = (dst.ctypes.data + dst_rows * dst.strides[0]).astype(np.uint64)
    return s, d, np.full(len(s), src.shape[1], dtype=np.uint64)


@lru_cache(maxsize=1)
def native_row_copy() -> NativeRowCopy | None:
    """The helper for this process, or None (then the numpy path copies; said once)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    if platform.machine().lower() not in _STREAMING_MACHINES:
        log.info("himamba: no streaming-store row copy on %s; using numpy", platform.machine())
        return None
    try:
        digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
        path = cache_dir() / f"row_copy-{digest}-{platform.machine().lower()}.so"
        if not path.exists():
            _build(SOURCE, path)
        return NativeRowCopy(path)
    except Exception as exc:  # any failure: the numpy path is always correct
        log.info("himamba: native row copy unavailable (%s); using numpy", exc)
        return None

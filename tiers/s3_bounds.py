"""S3 reads that never write past their buffer and never pass a short object off as whole.

LMCache 0.5.6's ``S3L2Adapter._get_request`` copies each body chunk of a GET to
``buffer + offset`` with no bound: an object longer than the buffer it is read into (damaged,
or written by something else under our key) would be copied past the end of our staging or
host-slot memory. A shorter one completes as a success with the buffer's tail left as it was.
Storage bytes are untrusted, so ``bound_gets`` gives one adapter instance a GET that

- refuses a chunk that would end past the buffer (the request fails: a miss), and
- fails a request whose chunks did not fill the buffer exactly.

It builds the request from the adapter's own parts (``_make_request``, its CRT client,
credentials and region), so signing, endpoints and TLS stay LMCache's. Where a part is missing
(another LMCache version) the adapter is refused at start-up rather than run unbounded.
"""

from __future__ import annotations

import ctypes
import threading
from concurrent.futures import Future
from typing import Any

_PARTS = ("_get_request", "_make_request", "_s3_client", "_credentials_provider", "_region")


class ObjectSizeError(RuntimeError):
    """A stored object's length differs from the size its reader expects."""


class _BoundedGet:
    """What the adapter keeps of a GET: ``finished_future``, which fails on a size mismatch.
    Holds the CRT request so it lives until it finishes."""

    __slots__ = ("request", "finished_future")

    def __init__(self, request: Any, finished: Future) -> None:
        self.request = request
        self.finished_future = finished


def bound_gets(adapter: Any) -> bool:
    """Give ``adapter`` (LMCache's S3 adapter) size-checked GETs; False if it is another
    adapter. Raises RuntimeError when it is the S3 adapter without the parts this needs."""
    if type(adapter).__name__ != "S3L2Adapter":
        return False
    missing = [p for p in _PARTS if not hasattr(adapter, p)]
    if missing:
        raise RuntimeError(
            "himamba: this LMCache's s3 adapter lacks "
            f"{', '.join(missing)}; its reads cannot be bounded, so it is not used"
        )
    from awscrt import s3

    def get_request(key_str: str, mem_obj: Any) -> _BoundedGet:
        size = len(mem_obj.byte_array)
        base = mem_obj.data_ptr
        lock = threading.Lock()
        received = [0]

        def on_body(chunk: Any, offset: int, **_: Any) -> None:
            n = len(chunk)
            if offset < 0 or offset + n > size:
                raise ObjectSizeError(f"S3 object {key_str} is longer than {size} bytes")
            ctypes.memmove(base + offset, chunk, n)
            with lock:
                received[0] += n

        request = s3.S3Request(
            client=adapter._s3_client,
            type=s3.S3RequestType.GET_OBJECT,
            request=adapter._make_request("GET", key_str),
            on_body=on_body,
            credential_provider=adapter._credentials_provider,
            region=adapter._region,
        )
        finished: Future = Future()

        def settle(f: Future) -> None:
            exc = f.exception()
            if exc is not None:
                finished.set_exception(exc)
            elif received[0] != size:
                finished.set_exception(
                    ObjectSizeError(f"S3 object {key_str}: {received[0]} bytes, expected {size}")
                )
            else:
                finished.set_result(None)

        request.finished_future.add_done_callback(settle)
        return _BoundedGet(request, finished)

    adapter._get_request = get_request
    return True

"""Secrets out of logs, errors and status answers: one redaction for every storage URL form."""

from __future__ import annotations

from typing import TypeVar

_T = TypeVar("_T")

SECRET_KEYS = ("password", "secret", "token", "credential")
REDACTED = "***"


def redacted_url(url: _T) -> _T | str:
    """``url`` with its password (``scheme://user:pw@host``) replaced by ``***``, for logs,
    errors and status answers; anything that is not a URL with a password comes back as it is.
    The user name stays: it tells which account a log line is about.

    Not ``urlsplit``: a password may hold characters (``/``, ``?``, ``#``) that move its split,
    and a cluster URL has several hosts; the last ``@`` before the hosts is unambiguous."""
    if not isinstance(url, str):
        return url
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() == "file":  # a path may hold an "@"; it has no password
        return url
    userinfo, at, hosts = rest.rpartition("@")
    if not at:
        return url
    user, colon, _ = userinfo.partition(":")
    return f"{scheme}://{user}{':' + REDACTED if colon else ''}@{hosts}"

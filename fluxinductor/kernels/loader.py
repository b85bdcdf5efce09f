"""The one loader of the CUDA extension, ``fluxinductor._C`` (every kernel module goes through it).

Importing fluxinductor never needs the extension or CUDA: it is imported on first use, once, and where it is missing
or does not load the reason is kept and returned (the ops then decompose), or raised by :func:`extension`.
"""

from __future__ import annotations

import threading
from typing import Optional

_extension = None
_extension_reason: Optional[str] = None
_extension_tried = False
_lock = threading.Lock()


def extension():
    """The loaded ``fluxinductor._C`` module; raises RuntimeError with the reason when it is not there."""
    reason = extension_available()
    if reason is not None:
        raise RuntimeError(reason)
    return _extension


def extension_available() -> Optional[str]:
    """None when ``fluxinductor._C`` imports, else why it does not (checked once, lazily)."""
    global _extension, _extension_reason, _extension_tried
    if not _extension_tried:
        with _lock:
            if not _extension_tried:
                try:
                    from fluxinductor import _C  # noqa: PLC0415 - lazy on purpose

                    _extension = _C
                except ImportError as e:
                    _extension_reason = f"fluxinductor._C is not built or does not load ({e})"
                _extension_tried = True
    return _extension_reason

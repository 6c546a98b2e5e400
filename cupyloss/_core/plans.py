"""The engines' plan caches: each call's metadata maps to a ready plan, in a bounded dict."""

from __future__ import annotations

import threading

# Plans a cache keeps (a plan is its kernels' handles and packed words: well under a kilobyte).
PLANS_KEPT = 4096


class Plans(dict):
    """A dict of plans keeping at most `size`: inserting one more drops the oldest (insertion
    order), so a program that meets ever new shapes holds a bounded number.  Lookups are a
    dict's own, nothing reordered on a hit: a dropped plan is built again when its shape
    returns.  Inserts, and the drop they make, hold the cache's lock, so threads that insert
    at once never drop one plan twice."""

    def __init__(self, size: int = PLANS_KEPT):
        super().__init__()
        self.size = size
        self._lock = threading.Lock()

    def __setitem__(self, key, value) -> None:
        with self._lock:
            while key not in self and len(self) >= self.size:
                super().pop(next(iter(self)), None)
            super().__setitem__(key, value)

"""Memos of the estimator's pure functions of a model's config, for a process that estimates many times (a plan asks
for the same profiles hundreds of times; a server plans the same model again and again).

A function of a config dict is memoized under the config's digest, which is computed once per config object: the
object is compared to a private copy of the contents it had when digested, so that an equal config (a plan's every
call, a later request for the same model) finds its digest at the cost of a dict comparison, and a config edited or
replaced since does not (its digest is computed afresh).
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")

_KEPT = 4096  # entries a memo keeps before it starts over
_DIGESTS: dict[int, tuple[dict[str, Any], str]] = {}  # id(config) → (a copy of its contents, digest)


def config_digest(config: dict[str, Any]) -> str:
    """A digest of `config`'s contents."""
    entry = _DIGESTS.get(id(config))
    if entry is not None and entry[0] == config:
        return entry[1]
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()
    if len(_DIGESTS) >= _KEPT:
        _DIGESTS.clear()
    _DIGESTS[id(config)] = (copy.deepcopy(config), digest)
    return digest


class Memo:
    """Results of one pure function by its arguments' key."""

    def __init__(self) -> None:
        self._results: dict[Hashable, Any] = {}

    def get(self, key: Hashable, compute: Callable[[], T]) -> T:
        try:
            return self._results[key]  # type: ignore[no-any-return]
        except KeyError:
            pass
        except TypeError:  # an argument that cannot be a key: computed each time
            return compute()
        result = compute()
        if len(self._results) >= _KEPT:
            self._results.clear()
        self._results[key] = result
        return result

"""The invariance probe on the embedded model: a full-precision cache gives the same greedy tokens on a prefix hit and
under chunked prefill, and the probe reports every format it was asked for."""

from __future__ import annotations

import json
from pathlib import Path

from nanokv_tools.eval import invariance


def test_full_precision_cache_is_invariant(tmp_path: Path) -> None:
    out = tmp_path / "inv.json"
    rc = invariance.main(["--bits", "16,8", "--prompts", "2", "--max-tokens", "8", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert set(res) == {"16", "8"}
    for way in ("prefix_hit", "chunked_64"):
        assert res["16"][way]["identical"] == 2 and res["16"][way]["first_difference"] == [None, None]
        assert res["8"][way]["of"] == 2
    assert min(res["16"]["prefix_hit"]["cached_tokens"]) >= 256  # the second pass really hit the cache
    assert res["16"]["chunked_64"]["cached_tokens"] == [0, 0]

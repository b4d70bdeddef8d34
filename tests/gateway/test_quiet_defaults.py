"""Quiet defaults: the default configuration starts without a warning, `nanokv simulate` states each
policy caveat once, and only a choice the user should reconsider (a retired policy) still warns.

A default that warns about itself teaches users to ignore warnings; the caveats are information
(docs/cache-policies.md, the --eviction-policy help, simulate's summary)."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

from nanokv import LLM
from nanokv.cache_service.policies import CAVEATS, RETIRED, PolicyCaveatWarning
from nanokv.cache_service.policies import _warned as warned_policies
from nanokv.config import EngineConfig
from nanokv.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


def _ours(record: list[warnings.WarningMessage]) -> list[str]:
    """Warnings raised by nanokv's code (attributed to a file of this repository) or of its classes."""
    return [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in record
            if Path(w.filename).resolve().is_relative_to(ROOT) or w.category.__module__.startswith("nanokv")]


def test_the_default_configuration_starts_and_generates_without_a_warning() -> None:
    assert EngineConfig().eviction_policy in CAVEATS  # the default (clock) does carry a caveat
    warned_policies.clear()  # as in a fresh process
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        llm = LLM(num_gpu_blocks=64)
        out = llm.generate(["The capital of France is"], GREEDY, use_tqdm=False)
    assert len(out[0].token_ids) == 4
    assert _ours(got) == []


def test_an_explicitly_chosen_retired_policy_warns_once() -> None:
    assert RETIRED == {"depth_lru"}
    warned_policies.discard("depth_lru")
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        llm = LLM(num_gpu_blocks=64, eviction_policy="depth_lru")
        llm.generate(["The capital of France is"], GREEDY, use_tqdm=False)
    caveats = [w for w in got if issubclass(w.category, PolicyCaveatWarning)]
    assert len(caveats) == 1, _ours(got)
    msg = str(caveats[0].message)
    assert "depth_lru" in msg and "retired" in msg and "use leaf_lru" in msg


def test_simulate_states_each_caveat_once_and_issues_no_warning() -> None:
    # two worker processes, so a warning per policy and process would show up twice
    policies = ["lru", "clock", "sieve", "depth_lru", "leaf_lru"]
    proc = subprocess.run([sys.executable, "-m", "nanokv.cli", "simulate", "--trace", "synthetic:shared_prompt",
                           "--policies", ",".join(policies), "--capacity", "5%,25%", "--jobs", "2",
                           "--no-progress"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Warning" not in proc.stderr and "warn" not in proc.stderr.lower(), proc.stderr
    for p in ("clock", "sieve", "depth_lru"):
        assert proc.stdout.count(CAVEATS[p]) == 1, (p, proc.stdout)
    block = proc.stdout.split("caveats (docs/cache-policies.md):\n")
    assert len(block) == 2, proc.stdout  # one summary block, after the table
    assert [line.split(":")[0].strip() for line in block[1].splitlines()] == ["clock", "sieve", "depth_lru"]

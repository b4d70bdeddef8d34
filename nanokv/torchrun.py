"""`torchrun ... -m nanokv.torchrun generate|serve|bench ... [nanokv flags]`: tensor parallelism
over processes that torchrun started. Ranks > 0 serve rank 0's engine
(nanokv.compute_service.runner.tp_worker); rank 0 is `nanokv ARGS`."""

from __future__ import annotations

import sys

from nanokv.compute_service.runner.tp_worker import run_worker_if_torchrun, torchrun_env


def main(argv: list[str] | None = None) -> int:
    """Rank 0 runs the command line with one rank per torchrun process; the others serve it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    env = torchrun_env()
    if env is None:
        print("nanokv.torchrun: run me under torchrun (RANK/WORLD_SIZE not set, or WORLD_SIZE 1); "
              "on one host `nanokv ... --tensor-parallel-size N` starts its own workers", file=sys.stderr)
        return 2
    if env.rank != 0:
        run_worker_if_torchrun()
        return 0
    has_tp = any(a.startswith("--tensor-parallel-size") for a in argv)
    if argv[:1] in (["generate"], ["serve"], ["bench"]) and not has_tp:
        argv += ["--tensor-parallel-size", str(env.world_size)]  # one rank per torchrun process
    from nanokv.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())

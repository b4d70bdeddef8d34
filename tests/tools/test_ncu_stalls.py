"""The Nsight Compute summary reads a source-page CSV export: stall shares and the loop's opcodes."""

from __future__ import annotations

import csv
from pathlib import Path

from nanokv_tools.bench import ncu_stalls


def test_summary_of_a_source_page_export(tmp_path: Path, capsys) -> None:
    hdr = ["Address", "Source", "Instructions Executed", "stall_long_sb", "stall_wait", "stall_wait (Not Issued)"]
    rows = [["0x0", "  LDC R1, c[0x0][0x28]", "4", "1", "0", "9"],
            ["0x10", "  HMMA.16816.F32 R4, R8, R12, R4", "64", "6", "2", "9"],
            ["0x20", "  @P0 LDGSTS.E.BYPASS.128 [R2], desc[UR4][R6.64]", "64", "0", "1", "9"]]
    path = tmp_path / "k.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "k"])
        w.writerow(hdr)
        w.writerows(rows)
    assert ncu_stalls.main([str(path), "--loop-count", "64"]) == 0
    out = capsys.readouterr().out
    assert "k: 10 stall samples" in out  # the "(Not Issued)" column is not counted twice
    assert "stall_long_sb             70.0%" in out and "stall_wait                30.0%" in out
    assert "executed warp instructions: 132" in out
    assert "main loop: 2 instructions per iteration" in out
    assert "HMMA.16816.F32 1" in out and "LDGSTS.E.BYPASS.128 1" in out

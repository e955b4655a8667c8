"""scripts/benchmd.py: the one writer of BENCHMARKS.md's targets table."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import benchmd  # noqa: E402


def test_benchmd_replaces_only_the_named_benchmarks_rows(tmp_path, monkeypatch):
    """`benchmd.py FILE --rows save`: the save rows from the new record, every other row
    and the section's text as they were; a name with no record keeps its rows."""
    monkeypatch.setattr(benchmd, "TARGETS_DIR", tmp_path / "records")
    md = tmp_path / "B.md"
    md.write_text("# B\n\n## Targets\n\nintro\n\n| benchmark | what | measured | target | met? |\n|---|---|---|---|---|\n"
                  "| save | delta | 0.04 | <= 0.5 | met |\n| save | commit | 1.38 | <= 1.5 | met |\n"
                  "| data | seek | 0.9x | <= 2x | met |\n| chaos | scenarios | 19 of 19 | all | met |\n\n## Next\n")
    benchmd.record_targets("save", [("delta", "0.01", "<= 0.5", True), ("commit", "1.62", "<= 1.5", False)])
    benchmd.replace_rows(md, ["save", "chaos"])
    lines = md.read_text().splitlines()
    assert "| save | commit | 1.62 | <= 1.5 | **NOT met** |" in lines and "| save | commit | 1.38 | <= 1.5 | met |" not in lines
    assert lines.index("| save | delta | 0.01 | <= 0.5 | met |") < lines.index("| data | seek | 0.9x | <= 2x | met |")
    assert "| chaos | scenarios | 19 of 19 | all | met |" in lines and "intro" in lines and lines[-1] == "## Next"
    assert sum(line.startswith("| save |") for line in lines) == 2

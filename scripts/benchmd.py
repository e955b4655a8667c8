"""The one place the benchmark scripts write BENCHMARKS.md: each owns one `## ` section."""

import json
import os
import sys
from pathlib import Path


def host() -> str:
    """The machine a section was measured on: this project's machines change host from
    day to day (CPU model, vector units, memory bandwidth), and a step's time with them."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        return "unknown"
    flags = info.get("flags", "").split()
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    from titan_ckpt_plus.cpu_fallback import cpu_has_bf16_dot

    bf16 = ("bf16 dot products" if cpu_has_bf16_dot()
            else "no bf16 dot products (the jobs train in fp32 mixed precision: cpu_fallback.fp32_args)")
    return f"{info.get('model name', 'unknown CPU')}, {vector}, {bf16}, {os.cpu_count()} cores"


def update_section(path: Path, title: str, body: str, measured_on: str | None = None) -> None:
    """Replace section `title` (up to the next `## ` heading) with `body` and the host
    it was measured on (this one unless `measured_on` names another), or append it."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{title}\n\n{body.strip()}\n\nMeasured on: {measured_on or host()}.\n"
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip() == title), None)
    if start is None:
        path.write_text(text.rstrip("\n") + "\n\n" + block)
        return
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    tail = "".join(lines[end:])
    path.write_text("".join(lines[:start]) + block + ("\n" + tail if tail else ""))


# ---- the targets table: every script records its targets, one table shows them all ----

TARGETS_DIR = Path(__file__).resolve().parent.parent / "outputs" / "bench-targets"
TARGETS_SECTION = "## Targets"


def record_targets(name: str, rows: list[tuple]) -> None:
    """Rows (what, measured, target, met: bool | None) of one script's run, kept for
    the targets table that scripts/bench_all.sh writes after every script ran."""
    TARGETS_DIR.mkdir(parents=True, exist_ok=True)
    (TARGETS_DIR / f"{name}.json").write_text(json.dumps([list(r) for r in rows], indent=1))


def targets_table(names: list[str]) -> str:
    lines = ["| benchmark | what | measured | target | met? |", "|---|---|---|---|---|"]
    for name in names:
        path = TARGETS_DIR / f"{name}.json"
        if not path.exists():
            lines.append(f"| {name} | (did not run) | | | |")
            continue
        for what, measured, target, met in json.loads(path.read_text()):
            verdict = "reported" if met is None else ("met" if met else "**NOT met**")
            lines.append(f"| {name} | {what} | {measured} | {target} | {verdict} |")
    return "\n".join(lines)


def replace_rows(path: Path, names: list[str]) -> None:
    """The targets table's rows of `names` from their records, the rest of the section as it
    stands: a script rerun alone (its own --update) brings its rows up to date without a
    whole bench_all.sh run. A name with no record keeps its rows."""
    fresh = {n: targets_table([n]).splitlines()[2:] for n in names if (TARGETS_DIR / f"{n}.json").exists()}
    out, done = [], set()
    for line in path.read_text().splitlines():
        name = line[2:].split(" | ")[0] if line.startswith("| ") else None
        if name in fresh:
            if name not in done:
                out += fresh[name]
                done.add(name)
            continue
        out.append(line)
    path.write_text("\n".join(out) + "\n")


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):  # a "--help" would be written as a file
        sys.exit("usage: benchmd.py BENCHMARKS.md [--rows] NAME...: the targets table from the scripts' "
                 "recorded rows (all of them, or with --rows only those rows replaced)")
    if sys.argv[2:3] == ["--rows"]:  # benchmd.py FILE --rows NAME...: only those rows
        replace_rows(Path(sys.argv[1]), sys.argv[3:])
        sys.exit()
    out, names = Path(sys.argv[1]), sys.argv[2:]
    body = ("Every target of the issues, from the run of `./scripts/bench_all.sh` that wrote the "
            "sections below (same machine, same run).\n\n" + targets_table(names))
    print(body)
    update_section(out, TARGETS_SECTION, body)

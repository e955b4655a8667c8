"""The one place the benchmark scripts write BENCHMARKS.md: each owns one `## ` section."""

from pathlib import Path


def update_section(path: Path, title: str, body: str) -> None:
    """Replace section `title` (up to the next `## ` heading) with `body`, or append it."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{title}\n\n{body.strip()}\n"
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip() == title), None)
    if start is None:
        path.write_text(text.rstrip("\n") + "\n\n" + block)
        return
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    tail = "".join(lines[end:])
    path.write_text("".join(lines[:start]) + block + ("\n" + tail if tail else ""))

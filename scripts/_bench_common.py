"""What every benchmark under ``scripts/`` shares: the launcher test, core counts, warnings about
measurements that would mislead, ``RxU`` parsing, plain-text tables and the JSON output.

Every benchmark prints a readable table, then its notes and warnings, then the whole report as
JSON on the **last line** of its output (``python scripts/bench_x.py | tail -n 1`` is
machine-readable); ``--json PATH`` also writes it, indented, to a file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "under_torchrun",
    "usable_cores",
    "time_sharing_warning",
    "few_iterations_warning",
    "parse_configs",
    "table",
    "emit",
]


def under_torchrun() -> bool:
    """Whether this process was started by ``torchrun`` (``RANK`` and ``WORLD_SIZE`` are set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, not the machine's core count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def time_sharing_warning(ranks: int, cores: int, device: str) -> str | None:
    """A warning when ``ranks`` single-threaded CPU ranks share fewer ``cores``, else ``None``.

    Each rank then runs only part of the time: an absolute time or a speedup over one process is
    not what the ranks would take on their own cores. Ratios between configurations measured the
    same way in one run (same ranks, same cores, interleaved) remain comparable.
    """
    if device != "cpu" or ranks <= cores:
        return None
    return (
        f"WARNING: {ranks} CPU ranks time-share {cores} core(s): absolute times and speedups over "
        "one process include the time-sharing and do not predict one core per rank; compare only "
        "ratios between configurations of this run"
    )


def few_iterations_warning(iters: int) -> str | None:
    """A warning when a median is taken over fewer than 3 timed iterations."""
    if iters >= 3:
        return None
    return f"WARNING: median over only {iters} timed iteration(s); use --iters 3 or more for stable ratios"


def parse_configs(text: str, option: str = "--configs") -> list[tuple[int, int]]:
    """``"4x1,2x2"`` -> ``[(4, 1), (2, 2)]`` (ring x Ulysses).

    Raises:
        SystemExit: for an item that is not two positive ints joined by ``x``.
    """
    out = []
    for item in text.split(","):
        try:
            r, u = (int(x) for x in item.lower().split("x"))
        except ValueError:
            raise SystemExit(f"{option}: expected items like 2x2 (ring x ulysses), got {item!r}") from None
        if r < 1 or u < 1:
            raise SystemExit(f"{option}: ring and ulysses sizes must be positive, got {item!r}")
        out.append((r, u))
    return out


def table(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table: the first column left-aligned, the others right-aligned; floats as
    given (format them before), ``None`` as ``-``."""
    cells = [[("-" if v is None else str(v)) for v in row] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths)))

    return "\n".join([line(columns), "  ".join("-" * w for w in widths), *(line(r) for r in cells)])


def emit(report: dict, text: str, notes: Sequence[str | None] = (), json_path: str | Path | None = None) -> None:
    """Print ``text`` (the tables), the non-empty ``notes``, then ``report`` as one JSON line.

    ``report`` gets a ``"notes"`` entry with the notes; ``json_path`` also receives it, indented.
    """
    notes = [n for n in notes if n]
    report = {**report, "notes": notes}
    print(text)
    for n in notes:
        print(n)
    if json_path is not None:
        Path(json_path).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {json_path}")
    print(json.dumps(report, separators=(",", ":")))

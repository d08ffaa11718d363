"""What the scripts under ``scripts/`` print and save: plain-text tables, the JSON report, the
``--plot`` bar chart and readable ``--help``.

Every benchmark prints a readable table, then its notes and warnings, then the whole report as
JSON on the **last line** of its output (``python scripts/bench_x.py | tail -n 1`` is
machine-readable, :func:`emit`); ``--json PATH`` also writes it, indented, to a file, and ``--plot
PATH`` saves a bar chart of its main ratios (:func:`chart`, :func:`plot_bars`; needs matplotlib,
the ``train`` extra). :func:`script_parser` and :func:`add_output_arguments` build those command
lines; the training and example scripts use :func:`plain` and :class:`HelpFormatter` (or
:func:`script_parser`) for their ``--help`` too.
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import json
import math
import os
import re
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "table",
    "emit",
    "plain",
    "HelpFormatter",
    "script_parser",
    "add_output_arguments",
    "add_plot_argument",
    "chart",
    "chart_panels",
    "Panel",
    "plot_bars",
    "plot_panels",
    "progress",
    "progress_bar",
    "origin",
    "announce",
]

_MATPLOTLIB_MISSING = 'matplotlib is not installed; install it with: pip install -e ".[train]"'


def table(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table: the first column left-aligned, the others right-aligned; floats as
    given (format them before), ``None`` as ``-``."""
    cells = [[("-" if v is None else str(v)) for v in row] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths)))

    return "\n".join([line(columns), "  ".join("-" * w for w in widths), *(line(r) for r in cells)])


def emit(
    report: dict,
    text: str,
    notes: Sequence[str | None] = (),
    json_path: str | Path | None = None,
    plot: Callable[[], object] | None = None,
) -> None:
    """Print ``text`` (the tables), the non-empty ``notes``, then ``report`` as one JSON line.

    ``report`` gets a ``"notes"`` entry with the notes; ``json_path`` also receives it, indented.
    ``plot`` (``--plot``: :func:`chart`) is called after the notes, so that the JSON line stays the
    last line of the output.
    """
    notes = [n for n in notes if n]
    report = {**report, "notes": notes}
    print(text)
    for n in notes:
        print(n)
    if plot is not None:
        plot()
    if json_path is not None:
        Path(json_path).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {json_path}")
    print(json.dumps(report, separators=(",", ":")))


# ---------------------------------------------------------------------------------------------
# --help

_LITERAL = re.compile(r"``(.+?)``", re.DOTALL)  # inline literal: kept verbatim, backticks dropped
_ROLE = re.compile(r":(?:[a-z]+:)?[a-z]+:`~?([^`]+)`")  # :func:`x`, :py:meth:`~a.b`
_STRONG = re.compile(r"(?<![\w*])\*\*(?=\S)(.+?)(?<=\S)\*\*(?![\w*])")
_EMPHASIS = re.compile(r"(?<![\w*])\*(?=[^\s*])(.+?)(?<=[^\s*])\*(?![\w*])")
_INTERPRETED = re.compile(r"(?<![\w`])`([^`\s][^`]*)`(?![\w`])")  # `x`
_LITERAL_BLOCK = re.compile(r"(\S)::$|^\s*::$", re.MULTILINE)  # "Examples::" -> "Examples:"


def plain(doc: str) -> str:
    """``doc`` (a reStructuredText docstring) as plain text for ``--help``.

    Inline literals (double backticks), roles (``:func:`x```), interpreted text (single
    backticks) and emphasis (``*x*``, ``**x**``) become their text; a paragraph ending in ``::``
    ends in ``:``. Text inside inline literals is kept as written (``len**2`` stays), and so is
    everything else: line breaks, indentation, lists.
    """
    parts = _LITERAL.split(doc.strip("\n"))
    for i in range(0, len(parts), 2):  # even parts are outside inline literals
        text = _ROLE.sub(r"\1", parts[i])
        text = _STRONG.sub(r"\1", text)
        text = _EMPHASIS.sub(r"\1", text)
        text = _INTERPRETED.sub(r"\1", text)
        parts[i] = _LITERAL_BLOCK.sub(lambda m: m.group(1) + ":" if m.group(1) else "", text)
    return "".join(parts)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--help`` that keeps the description's line breaks and shows every option's default.

    The default is appended as ``(default: X)`` unless the option's help already mentions one
    (``"tokens (default 64)"``, ``"default: --heads"``). Not shown: ``None`` (no default) and the
    ``False``/``True`` of a plain on/off flag (``store_true``); an option without help text gets
    just its default.
    """

    @staticmethod
    def _shown_default(action: argparse.Action) -> str | None:
        default = action.default
        if default is None or default is argparse.SUPPRESS:
            return None
        if action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction):
            return None  # store_true / store_false / store_const / count / help
        if isinstance(default, (list, tuple)):
            return " ".join(map(str, default))
        return repr(default) if default == "" else str(default)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = self._shown_default(action)
        if shown is None or re.search(r"\bdefault", text, re.IGNORECASE):
            return text
        suffix = f"(default: {shown})".replace("%", "%%")
        return f"{text} {suffix}" if text else suffix

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and self._shown_default(action) is not None:
            action = copy.copy(action)  # argparse prints no help line for help=None
            action.help = self._get_help_string(action)
        return super()._format_action(action)


# ---------------------------------------------------------------------------------------------
# --plot


def origin() -> str:
    """Which seqpar this process imported, and with which interpreter: ``"seqpar 0.4.0 from
    /path/to/seqpar (python /path/to/python)"``. A ``torchrun`` outside the virtualenv (one made
    with ``--system-site-packages`` resolves ``torchrun`` to the system's) imports another seqpar:
    this line shows it."""
    import seqpar

    return f"seqpar {seqpar.__version__} from {Path(seqpar.__file__).parent} (python {sys.executable})"


def announce(prog: str) -> None:
    """Print ``"<prog>: <origin()>"`` on stderr, once per job (rank 0 under ``torchrun``)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"{prog}: {origin()}", file=sys.stderr, flush=True)


class _ScriptParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that announces which seqpar runs (:func:`announce`) once the command
    line parsed (not for ``--help`` or a usage error)."""

    def parse_args(self, args=None, namespace=None):  # noqa: D102 - argparse's
        parsed = super().parse_args(args, namespace)
        announce(self.prog)
        return parsed


def script_parser(doc: str) -> argparse.ArgumentParser:
    """A script's command line: ``doc`` (its module docstring) as the description, in plain text,
    and every option's default shown (:class:`HelpFormatter`); parsing it prints which seqpar the
    script imported on stderr (:func:`announce`)."""
    return _ScriptParser(description=plain(doc), formatter_class=HelpFormatter)


def add_output_arguments(parser: argparse.ArgumentParser, chart: str) -> None:
    """A benchmark's last two options: ``--json PATH`` (also write the JSON report to this file)
    and ``--plot PATH`` (save a bar chart of ``chart``, :func:`add_plot_argument`)."""
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the JSON report to this file")
    add_plot_argument(parser, chart)


def _plot_path(text: str) -> str:
    """``--plot``'s type: fails at parse time (not after the run) without matplotlib or with a
    missing folder."""
    if not text:
        raise argparse.ArgumentTypeError("expected an image file path, e.g. chart.png")
    if importlib.util.find_spec("matplotlib") is None:
        raise argparse.ArgumentTypeError(_MATPLOTLIB_MISSING)
    folder = Path(text).expanduser().parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"folder {str(folder)!r} does not exist")
    return text


def add_plot_argument(parser: argparse.ArgumentParser, chart: str) -> None:
    """Add ``--plot PATH``: save a bar chart of ``chart`` (what the benchmark plots) to ``PATH``."""
    parser.add_argument(
        "--plot", metavar="PATH", type=_plot_path, default=None,
        help=f"save a bar chart of {chart} to this image (PNG, SVG or PDF, by suffix); needs matplotlib: "
        'pip install -e ".[train]"',
    )


def chart(path: str | Path | None, *args: object, **kwargs: object) -> Callable[[], None] | None:
    """``--plot``'s chart for :func:`emit`: :func:`plot_bars` of ``path`` and the arguments, to be
    called later; ``None`` when no ``path`` was given."""
    return None if path is None else functools.partial(plot_bars, path, *args, **kwargs)


def chart_panels(path: str | Path | None, *args: object, **kwargs: object) -> Callable[[], None] | None:
    """As :func:`chart`, for :func:`plot_panels` (one quantity per axis)."""
    return None if path is None else functools.partial(plot_panels, path, *args, **kwargs)


@dataclass(frozen=True)
class Panel:
    """One axis of :func:`plot_panels`: series of one quantity.

    Attributes:
        value_label: the axis title, saying which way is better (``"speedup (higher is better)"``).
        series: legend name -> one value per row.
        reference_line: a value to mark with a dashed line (the ideal, parity), or ``None``.
        value_format: how each bar's value is written.
    """

    value_label: str
    series: dict[str, Sequence[float | None]]
    reference_line: float | None = 1.0
    value_format: str = ".3f"


def plot_bars(
    path: str | Path,
    title: str,
    labels: Sequence[str],
    series: dict[str, Sequence[float | None]],
    value_label: str,
    reference_line: float | None = 1.0,
    value_format: str = ".3f",
) -> None:
    """Save a horizontal grouped bar chart of one quantity: one row per label, one bar per series,
    each bar annotated with its value (:func:`plot_panels` with one :class:`Panel`).

    Bars start at 0, so their lengths compare; ``reference_line`` (e.g. 1.0 for a ratio: parity,
    the ideal) is drawn as a dashed line across them. A ``None`` or NaN value draws no bar (its row
    says ``n/a``), nor does an infinite one (written as ``inf``).

    Args:
        path: the image file; its suffix picks the format (``.png``, ``.svg``, ``.pdf``).
        labels: the rows, top to bottom (e.g. configurations).
        series: legend name -> one value per label.
        value_label: the axis title of the values.
        value_format: how each bar's value is written (as in the benchmark's table).

    Raises:
        SystemExit: when matplotlib is not installed.
        ValueError: when a series does not have one value per label.
    """
    plot_panels(path, title, labels, [Panel(value_label, series, reference_line, value_format)])


def _draw_panel(ax, labels: Sequence[str], panel: Panel) -> None:
    """Bars from 0 of every series of ``panel`` on ``ax``, values written at their ends."""
    n, k = len(labels), max(1, len(panel.series))
    bar = 0.8 / k
    finite = [0.0] + ([panel.reference_line] if panel.reference_line is not None else [])
    for j, (name, values) in enumerate(panel.series.items()):
        vals = [math.nan if v is None else float(v) for v in values]
        pos = [i - 0.4 + bar * (j + 0.5) for i in range(n)]
        widths = [v if math.isfinite(v) else 0.0 for v in vals]
        bars = ax.barh(pos, widths, height=bar, label=name)
        texts = ["n/a" if math.isnan(v) else format(v, panel.value_format) for v in vals]
        ax.bar_label(bars, labels=texts, padding=2, fontsize=7)
        finite += [v for v in vals if math.isfinite(v)]
    low, high = min(finite), max(finite)
    span = (high - low) or 1.0
    ax.set_xlim(low - (0.05 * span if low < 0 else 0.0), high + 0.15 * span)  # room for the value labels
    ax.ticklabel_format(axis="x", useOffset=False)
    if panel.reference_line is not None:
        ax.axvline(panel.reference_line, color="0.3", linestyle="--", linewidth=1,
                   label=f"{format(panel.reference_line, 'g')} (reference)")
    ax.set_xlabel(panel.value_label)
    ax.grid(axis="x", alpha=0.3)
    if len(panel.series) > 1 or panel.reference_line is not None:
        ax.legend(fontsize=7, loc="lower left", bbox_to_anchor=(0, 1.0), ncol=min(len(panel.series) + 1, 4),
                  frameon=False)


def plot_panels(path: str | Path, title: str, labels: Sequence[str], panels: Sequence[Panel]) -> None:
    """Save one horizontal bar chart per :class:`Panel`, side by side over the same rows: one
    quantity per axis (a speedup, higher is better, never shares an axis with a memory ratio, lower
    is better). Bars start at 0; each panel's reference line marks its ideal.

    Args:
        path: the image file; its suffix picks the format.
        title: the figure's title.
        labels: the rows, top to bottom, shared by every panel.
        panels: the quantities, left to right.

    Raises:
        SystemExit: when matplotlib is not installed.
        ValueError: no panel, or a series without one value per label.
    """
    if not panels:
        raise ValueError("plot_panels: no panel to draw; pass at least one Panel")
    for panel in panels:
        for name, values in panel.series.items():
            if len(values) != len(labels):
                raise ValueError(f"plot_panels: series {name!r} has {len(values)} values for {len(labels)} labels")
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(f"--plot: {_MATPLOTLIB_MISSING}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n, k = len(labels), max(max(1, len(p.series)) for p in panels)
    label_room = 0.065 * max(map(len, labels), default=0)
    width = max(8.0, 4.5 + label_room + 3.5 * (len(panels) - 1))
    fig, axes = plt.subplots(1, len(panels), figsize=(width, 1.9 + n * (0.22 * k + 0.12)), sharey=True,
                             squeeze=False)
    for ax, panel in zip(axes[0], panels):
        _draw_panel(ax, labels, panel)
    axes[0][0].set_yticks(range(n), labels, fontsize=8)
    axes[0][0].set_ylim(n - 0.5, -0.5)  # first label on top
    fig.suptitle(textwrap.fill(title, int(width * 12)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


# ---------------------------------------------------------------------------------------------
# progress


def _is_first_rank() -> bool:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def progress(prog: str, text: str) -> None:
    """A progress line ``"<prog>: <text>"`` on stderr, on the first rank only (stdout keeps the
    table and the JSON line)."""
    if _is_first_rank():
        print(f"{prog}: {text}", file=sys.stderr, flush=True)


def progress_bar(items: Sequence, prog: str, what: str):
    """``items``, with a tqdm bar on stderr on the first rank (the ``train`` extra), or one
    :func:`progress` line per item without tqdm."""
    if not _is_first_rank():
        return iter(items)
    try:
        from tqdm import tqdm
    except ImportError:
        return _lines(items, prog, what)
    return tqdm(items, desc=f"{prog}: {what}", file=sys.stderr, leave=False)


def _lines(items: Sequence, prog: str, what: str):
    for i, item in enumerate(items):
        progress(prog, f"{what} {i + 1}/{len(items)}")
        yield item

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
    "plot_bars",
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


def plot_bars(
    path: str | Path,
    title: str,
    labels: Sequence[str],
    series: dict[str, Sequence[float | None]],
    value_label: str,
    reference_line: float | None = 1.0,
    value_format: str = ".3f",
) -> None:
    """Save a horizontal grouped bar chart: one row per label, one bar per series, each bar
    annotated with its value.

    With ``reference_line`` (e.g. 1.0 for a ratio: parity, the ideal) the bars start at that
    value, drawn as a dashed line, so a bar's length and direction show how far a ratio is from
    it; without, they start at 0. A ``None`` or NaN value draws no bar (its row says ``n/a``), nor
    does an infinite one (written as ``inf``).

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
    for name, values in series.items():
        if len(values) != len(labels):
            raise ValueError(f"plot_bars: series {name!r} has {len(values)} values for {len(labels)} labels")
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(f"--plot: {_MATPLOTLIB_MISSING}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = 0.0 if reference_line is None else reference_line
    n, k = len(labels), max(1, len(series))
    bar = 0.8 / k
    width = max(8.0, 4.5 + 0.065 * max(map(len, labels), default=0))  # room for long row labels
    fig, ax = plt.subplots(figsize=(width, 1.6 + n * (0.22 * k + 0.12)))
    finite = [base]
    for j, (name, values) in enumerate(series.items()):
        vals = [math.nan if v is None else float(v) for v in values]
        pos = [i - 0.4 + bar * (j + 0.5) for i in range(n)]
        widths = [v - base if math.isfinite(v) else 0.0 for v in vals]
        bars = ax.barh(pos, widths, height=bar, left=base, label=name)
        texts = ["n/a" if math.isnan(v) else format(v, value_format) for v in vals]
        ax.bar_label(bars, labels=texts, padding=2, fontsize=7)
        finite += [v for v in vals if math.isfinite(v)]
    low, high = min(finite), max(finite)
    # Never zoom in below 5% of the values: a 1.00004 next to 1.0 must not look like a big gap.
    span = max(high - low, 0.05 * max(abs(low), abs(high))) or 1.0
    ax.set_xlim(low - 0.12 * span, high + 0.12 * span)
    ax.ticklabel_format(axis="x", useOffset=False)
    if reference_line is not None:
        ax.axvline(reference_line, color="0.3", linestyle="--", linewidth=1)
    ax.set_yticks(range(n), labels, fontsize=8)
    ax.set_ylim(n - 0.5, -0.5)  # first label on top
    ax.set_xlabel(value_label)
    fig.suptitle(textwrap.fill(title, int(width * 12)), fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=7, loc="lower left", bbox_to_anchor=(0, 1.0), ncol=min(len(series), 4), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")

"""Argument types and helpers shared by the command-line programs (``lmfuse``'s verbs, the
demo, ``lmfuse generate`` and the bench harnesses): one bad argument is one line on stderr
and exit status 2. Below ``cli``, ``demo``, ``generate_cli`` and ``bench``, which import it
(``lmfuse.cli`` re-exports its names)."""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
from pathlib import Path
from typing import Callable, NoReturn, Optional

from ._launch import DTYPE_NAMES

#: The model dtypes the command lines take, by their short names.
DTYPES = {name: DTYPE_NAMES[name] for name in ("fp32", "fp16", "bf16")}


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: ``PROG: MESSAGE (see `PROG --help`)`` on stderr, exit
    status 2. (argparse's own prints the usage block first, which buries the message.)
    Subparsers inherit it; ``lmfuse demo`` and the bench harnesses use it too."""

    def error(self, message: str) -> NoReturn:
        message = " ".join(message.split())
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


def int_range(minimum: Optional[int] = None,
              maximum: Optional[int] = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``[minimum, maximum]`` (None: unbounded)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if minimum is not None and value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum}, got {value}")
        return value

    return parse


#: ``--seed``: what ``torch.manual_seed`` takes, from 0.
seed = int_range(0, 2**63 - 1)


def number_range(minimum: float, maximum: float = math.inf, *, above: bool = False,
                 note: str = "") -> Callable[[str], float]:
    """An argparse ``type``: a finite number ``>= minimum`` (``> minimum`` when ``above``)
    and ``<= maximum``; ``note`` follows the range in the error."""
    bounds = (f"{'>' if above else '>='} {minimum:g}" if maximum == math.inf
              else f"in {'(' if above else '['}{minimum:g}, {maximum:g}]")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be finite, got {text!r}")
        if not (minimum < value if above else minimum <= value) or value > maximum:
            raise argparse.ArgumentTypeError(f"must be {bounds}{note}, got {value}")
        return value

    return parse


def int_list(count: Optional[int] = None, form: str = "comma-separated integers",
             minimum: int = 1) -> Callable[[str], tuple[int, ...]]:
    """An argparse ``type``: ``count`` comma-separated integers (None: any number), each
    ``>= minimum``; ``form`` names what is expected in the error."""

    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(v) for v in text.split(","))
        except ValueError:
            values = ()
        if not values or len(values) != (count or len(values)):
            raise argparse.ArgumentTypeError(f"expected {form}, got {text!r}")
        if min(values) < minimum:
            raise argparse.ArgumentTypeError(f"each must be >= {minimum}, got {text!r}")
        return values

    return parse


def dtype_name(text: str) -> str:
    """An argparse ``type``: a name of :data:`DTYPES` (an unknown one is a usage error, not
    a KeyError)."""
    if text not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}; choose one of "
                                         f"{', '.join(DTYPES)}")
    return text


def output_file(text: str) -> str:
    """An argparse ``type``: a file to write, in a directory that exists, not a directory
    itself (so a long run does not fail at its end)."""
    parent = Path(text).parent
    if not text:
        raise argparse.ArgumentTypeError("cannot write '': give a file name")
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: it is a directory; give a "
                                         "file name in it")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: no directory {str(parent)!r}")
    path = Path(text)
    if not os.access(path if path.exists() else parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: permission denied")
    return text


def nonempty(text: str) -> str:
    """An argparse ``type``: any string but the empty one (a path given as ``''`` would
    name the current directory)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a non-empty value, got ''")
    return text


def plot_format_error(path: str) -> Optional[str]:
    """None when matplotlib writes ``path``'s format (no suffix: PNG, see
    :func:`plot_file`); else the line saying which formats it writes. Needs matplotlib."""
    suffix = Path(path).suffix.lower().lstrip(".")
    if not suffix:
        return None
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix in formats:
        return None
    return (f"{path!r}: matplotlib cannot write .{suffix} files; use one of "
            f".{', .'.join(sorted(formats))}")


def plot_file(path: str) -> str:
    """The file a figure saved to ``path`` lands in: matplotlib adds ``.png`` to a name
    without a suffix; given here, so that what is printed is what was written."""
    return path if Path(path).suffix else f"{path}.png"


def missing_package(module: str, needed_by: str, install: str) -> Optional[str]:
    """None when ``module`` can be imported; else the line saying that ``needed_by`` needs
    it and what to install (``install``: the pip argument)."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    return None if found else (f"{needed_by} needs {module}, which is not installed here: "
                               f"pip install {install}")

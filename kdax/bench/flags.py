"""argparse pieces shared by the ``kdax`` commands: value types whose errors argparse reports
with the flag's name (``kdax bench kda: error: argument --T: expected an int >= 1, got '-5'``),
a help formatter that states defaults, the shape and output flags of the benchmarks, and the
line that heads every table (device, jax version, date)."""

from __future__ import annotations

import argparse
import datetime
import json
import platform

import jax

SHAPE_HELP = {"B": "batch", "T": "tokens", "H": "heads", "K": "key head dim", "V": "value head dim"}
DTYPES = ("float32", "bfloat16", "float16")


def number(cast, ok, expected: str):
    """An argparse type: ``cast(text)`` where ``ok`` of it holds."""

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


def at_least(low: int):  # an int >= low
    return number(int, lambda n: n >= low, f"an int >= {low}")


percent = number(float, lambda x: 0 < x <= 100, "a percentage in (0, 100]")


def ints(text: str) -> tuple[int, ...]:  # "8,32" -> (8, 32)
    try:
        found = tuple(int(n) for n in text.split(","))
    except ValueError:
        found = ()
    if not found or min(found) < 1:
        raise argparse.ArgumentTypeError(f"expected N[,N...] of positive integers, got {text!r}")
    return found


def pairs(text: str) -> list[tuple[int, int]]:  # "1x2048,8x8192" -> [(1, 2048), (8, 8192)]
    try:
        found = [tuple(int(n) for n in item.split("x")) for item in text.split(",")]
    except ValueError:
        found = []
    if not found or any(len(p) != 2 or min(p) < 1 for p in found):
        raise argparse.ArgumentTypeError(f"expected AxB[,AxB...] of positive integers, got {text!r}")
    return found


def names(allowed: tuple[str, ...]):
    """An argparse type: a comma-separated list of names from ``allowed``."""

    def parse(text: str) -> tuple[str, ...]:
        found = tuple(n for n in text.split(",") if n)
        if not found or not set(found) <= set(allowed):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(allowed)}, got {text!r}")
        return found

    return parse


class Help(argparse.ArgumentDefaultsHelpFormatter):
    """Help that states each option's default, where it has one (not for flags, nor None)."""

    def _get_help_string(self, action):
        return action.help if action.default is None or action.default is False else super()._get_help_string(action)


def command(sub, name: str, run, help: str, description: str | None = None) -> argparse.ArgumentParser:
    """A subcommand of ``sub``: ``kdax.cli.main`` calls ``run(ns, parser)`` for its exit status."""
    p = sub.add_parser(name, help=help, description=description or help, formatter_class=Help, allow_abbrev=False)
    p.set_defaults(run=run, parser=p)
    return p


def shape(p: argparse.ArgumentParser, **defaults: int) -> None:
    """--B, --T, ... with these defaults (the dims given)."""
    for dim, default in defaults.items():
        p.add_argument(f"--{dim}", type=at_least(1), default=default, help=SHAPE_HELP[dim])


def output(p: argparse.ArgumentParser, repeats: int, json_flag: bool = True) -> None:
    """--repeats (timed calls per measurement) and --json."""
    p.add_argument("--repeats", type=at_least(1), default=repeats, help="timed calls per measurement (the median)")
    if json_flag:
        p.add_argument("--json", action="store_true", help="print JSON instead of the table")


def meta(ns: argparse.Namespace, device: bool = True) -> dict:
    """date, jax version, the command line and (``device``) the device of this process."""
    out = {"date": datetime.date.today().isoformat(), "jax": jax.__version__, "command": ns.command_line}
    if device:
        out["device"] = f"{jax.devices()[0].device_kind} ({platform.processor() or platform.machine()})"
    return out


def header(m: dict) -> str:
    return f"# {m['device']}, jax {m['jax']}, {m['date']}"


def emit(ns: argparse.Namespace, m: dict, key: str, data, table: str) -> int:
    """Print ``{"meta": m, key: data}`` as JSON with --json, else the header and the table."""
    print(json.dumps({"meta": m, key: data}, indent=2) if ns.json else f"{header(m)}\n{table}")
    return 0

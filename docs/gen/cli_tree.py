"""The `kvserve` parsers walked, for reference_cli.py and reference_env.py (imported by both, not run by mkdocs).

A flag's environment variable is found by trying it: the parsers are built once with no KVSERVE_* variable set
(the defaults the pages show), then with KVSERVE_<DEST> set for every flag, and a flag whose default follows its
variable names it.
"""

from __future__ import annotations

import argparse
import contextlib
import os

from kvserve.services.cli import build_parser

Command = tuple[str, ...]  # a command: ("kvserve", "admin", "stats")


@contextlib.contextmanager
def environ(values: dict[str, str]):
    """os.environ with no KVSERVE_* variable but ``values``, restored afterwards."""
    saved = dict(os.environ)
    for name in [n for n in os.environ if n.startswith("KVSERVE_")]:
        del os.environ[name]
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _walk(parser: argparse.ArgumentParser, path: Command, summary: str):
    yield path, parser, summary
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield from _walk(sub, (*path, name), helps.get(name, ""))


def commands(values: dict[str, str] | None = None) -> list[tuple[Command, argparse.ArgumentParser, str]]:
    """(path, parser, one-line help) for the program and every subcommand, depth first, built under ``values``."""
    with environ(values or {}):
        return list(_walk(build_parser(), ("kvserve",), ""))


def flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.help != argparse.SUPPRESS and a.dest != "help"
            and not isinstance(a, argparse._SubParsersAction)]


def env_vars() -> dict[tuple[Command, str], str]:
    """(command path, dest) -> KVSERVE_<DEST>, for every flag whose default that variable sets."""
    base = commands()
    dests = {a.dest for _, parser, _ in base for a in flags(parser)}
    marked = commands({f"KVSERVE_{d.upper()}": f"env:{d}" for d in dests})
    off = commands({f"KVSERVE_{d.upper()}": "0" for d in dests})
    out = {}
    for (path, parser, _), (_, m, _), (_, o, _) in zip(base, marked, off, strict=True):
        for action, m_action, o_action in zip(flags(parser), flags(m), flags(o), strict=True):
            if m_action.default != action.default or o_action.default != action.default:
                out[path, action.dest] = f"KVSERVE_{action.dest.upper()}"
    return out


def flag_name(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest.upper()}`"
    return " / ".join(f"`{s}`" for s in action.option_strings)


def default(action: argparse.Action) -> str:
    """The default as the pages show it: ``value``, on/off for switches, required, or empty for none."""
    if action.required:
        return "required"
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction | argparse.BooleanOptionalAction):
        return "on" if action.default else "off"
    if action.default is None or action.default == "":
        return ""
    return f"`{action.default}`"


def cell(text) -> str:
    """Text for a Markdown table cell: one line; pipes, and the '<' of placeholders like <data-dir>, escaped."""
    return " ".join(str(text).split()).replace("|", "\\|").replace("<", "&lt;")


def help_text(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%" in text:
        with contextlib.suppress(KeyError, TypeError, ValueError):
            text = text % {**vars(action), "prog": prog}
    if action.choices:
        text += f" (one of: {', '.join(map(str, action.choices))})"
    return cell(text)


def anchor(path: Command) -> str:
    """The id of a command's heading on reference/cli.md."""
    return "-".join(path)

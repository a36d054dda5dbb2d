"""reference/cli.md: every `kvserve` command and flag, read from the argparse parsers of kvserve/services/cli.py.

Run by mkdocs-gen-files at build time (the parsers are walked by cli_tree.py, beside this script).
"""

from __future__ import annotations

import sys
from pathlib import Path

import mkdocs_gen_files

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cli_tree as tree  # noqa: E402

PAGE = "reference/cli.md"


def render() -> str:
    envs = tree.env_vars()
    lines = ["# Command line", "",
             "Every `kvserve` command and flag, generated from the parsers in `kvserve/services/cli.py` when this "
             "site is built. A flag with a `KVSERVE_*` variable under its description takes its default from that "
             "variable when it is set (how `k8s/` configures the services); the *default* column is the value with no "
             "variable set. [Environment variables](env.md) lists them all.", ""]
    for path, parser, summary in tree.commands():
        own = tree.flags(parser)
        heading = "##" if len(path) <= 2 else "###"
        lines += [f"{heading} `{' '.join(path)}` {{#{tree.anchor(path)}}}", ""]
        description = parser.description if len(path) > 1 else "Flags of every command, given before it."
        for text in (summary, description):
            if text:
                lines += [tree.cell(text[0].upper() + text[1:]), ""]
        for group in parser._mutually_exclusive_groups:
            lines += [f"At most one of {', '.join(tree.flag_name(a) for a in group._group_actions)}.", ""]
        if own:
            lines += ['<div class="kv-flags" markdown>', "", "| flag | default | what it does |", "|---|---|---|"]
            for action in own:
                env = envs.get((path, action.dest))
                text = "<br>".join(t for t in (tree.help_text(action, parser.prog), f"`{env}`" if env else "") if t)
                lines.append(f"| {tree.flag_name(action)} | {tree.default(action)} | {text} |")
            lines += ["", "</div>", ""]
    return "\n".join(lines)


with mkdocs_gen_files.open(PAGE, "w") as f:
    f.write(render())

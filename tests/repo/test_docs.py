"""The documentation stays true to the repository (issue 36): every `kvserve <command> --flag` that README.md or
a page under docs/ names exists in the CLI's parsers, every repository path they name in inline code exists,
every page is in mkdocs.yml's nav (and every nav entry is a page), and `mkdocs build --strict` passes (internal
links and anchors resolve; the generated reference and benchmark pages build)."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvserve.services.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# The top-level folders (and, so that a path left from before the layers moved under kvserve/ is caught, their
# old names).
TOP = ("kvserve", "protos", "k8s", "image", "tests", "bench", "docs", ".ci", "common", "worker", "kvmanager", "kernels",
       "services")
MADE_AT_RUN_TIME = ("bench/wheelhouse/",)  # folders a documented step creates (gpu_check.sh reads wheels there)
ROOT_FILES = ("Makefile", "Containerfile", "Containerfile.cuda", "pyproject.toml", "mkdocs.yml", "README.md")
INLINE_CODE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
COMMAND = re.compile(r"\bkvserve\s+([a-z][a-z-]*(?:\s+[a-z][a-z-]*)?)((?:\s+[^\s#|;&`]+)*)")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(p for p in DOCS.rglob("*.md"))]


def logical_lines(text: str) -> list[str]:
    """Lines with shell continuations (a trailing backslash) joined."""
    return text.replace("\\\n", " ").splitlines()


def subcommand(parser: argparse.ArgumentParser, words: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The deepest subparser ``words`` name, and the words it did not consume."""
    while words:
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not actions or words[0] not in actions[0].choices:
            break
        parser, words = actions[0].choices[words[0]], words[1:]
    return parser, words


def own_options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def options(parser: argparse.ArgumentParser) -> set[str]:
    """Its flags; for a command of subcommands (`kvserve admin`), any of theirs too."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return own_options(parser).union(*(options(p) for a in subs for p in a.choices.values()))


def named_flags(text: str) -> list[tuple[str, str]]:
    """(command, flag) for every --flag that follows `kvserve <command>` on a logical line."""
    out = []
    for line in logical_lines(text):
        for m in COMMAND.finditer(line):
            words = m.group(1).split()
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", m.group(2)):
                out.append((" ".join(words), flag))
    return out


def unknown_flags(text: str, parser: argparse.ArgumentParser) -> list[str]:
    top = own_options(parser)  # `kvserve --log-level` before any command
    bad = []
    for words, flag in named_flags(text):
        sub, rest = subcommand(parser, words.split())
        if sub is parser:
            continue  # "kvserve serves ..." in prose: no command named
        if flag not in options(sub) | top:
            bad.append(f"kvserve {words} {flag}")
    return bad


def named_paths(text: str) -> list[str]:
    """Repository paths named in inline code: under a top-level folder, or a file at the root."""
    out = []
    for span in INLINE_CODE.findall(text):
        token = span.split()[0] if span.split() else ""
        token = token.split("::")[0].rstrip(".,:;)")
        if "://" in token or token.startswith("/"):
            continue
        if token in ROOT_FILES or (token.split("/")[0] in TOP and "/" in token):
            out.append(token)
    return out


def exists(path: str) -> bool:
    """``path`` exists; ``<placeholders>`` and globs match something; ``{a,b}`` alternatives all exist."""
    braces = re.search(r"\{([^{}]*)\}", path)
    if braces:
        return all(exists(path[:braces.start()] + alt + path[braces.end():]) for alt in braces.group(1).split(","))
    pattern = re.sub(r"<[^>]*>", "*", path).split(":")[0]
    if pattern in MADE_AT_RUN_TIME:
        return True
    if any(c in pattern for c in "*?["):
        return any(ROOT.glob(pattern))
    return (ROOT / pattern).exists()


def test_the_checks_catch_a_renamed_flag_and_a_moved_path():
    parser = build_parser()
    text = "Run `kvserve up --num-pages 64 --kv-cache-dtype int8` or\n    kvserve admin stats --json\n"
    assert unknown_flags(text, parser) == []
    assert unknown_flags(text.replace("--num-pages", "--num-page"), parser) == ["kvserve up --num-page"]
    assert unknown_flags("kvserve worker --port 1 \\\n  --no-such-flag", parser) == ["kvserve worker --no-such-flag"]
    paths = named_paths("see `kvserve/services/gateway/engine.py`, `bench/results/fuzz-<date>.json` and `k8s/`")
    assert paths == ["kvserve/services/gateway/engine.py", "bench/results/fuzz-<date>.json", "k8s/"]
    assert all(map(exists, paths)) and not exists("kvserve/services/gateway/engin.py")


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_kvserve_flag_the_docs_name_exists(path):
    assert unknown_flags(path.read_text(), build_parser()) == []


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_the_docs_name_exists(path):
    assert [p for p in named_paths(path.read_text()) if not exists(p)] == []


def test_the_readme_links_only_to_files_that_exist():
    """GitHub shows README.md outside the site: its relative links must name files in the repository (the
    generated reference pages exist only in the built site)."""
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    assert [link for link in links if "://" not in link and not (ROOT / link).exists()] == []


class _AnyTag(yaml.SafeLoader):
    """mkdocs.yml may hold python tags (!!python/name:...): read them as plain values."""


_AnyTag.add_multi_constructor("", lambda loader, suffix, node: None)


def nav_pages(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [p for v in nav.values() for p in nav_pages(v)]
    return [p for item in nav for p in nav_pages(item)]


def test_every_page_is_in_the_nav_and_every_nav_entry_is_a_page():
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_AnyTag)
    nav = nav_pages(config["nav"])
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    generated = set(nav) - pages
    assert generated <= {p for p in nav if p.startswith(("reference/", "benchmarks/"))}, generated
    assert sorted(pages - set(nav)) == []
    assert len(nav) == len(set(nav))


@pytest.mark.slow  # a whole site build, over a minute: `make docs` in CI runs the same
def test_the_site_builds_strict(tmp_path):
    """Internal links, anchors and the nav resolve; the generated reference and benchmark pages build."""
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir",
                           str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_AnyTag)
    for page in nav_pages(config["nav"]):
        built = tmp_path / "site" / (page.removesuffix(".md").removesuffix("index") + "/index.html").lstrip("/")
        assert built.exists() or (tmp_path / "site" / page.replace(".md", ".html")).exists(), page


def test_the_readme_headline_is_the_newest_full_report():
    """The front page's headline ratios (kvserve against vLLM and HF) are written by bench/headline.py from the
    newest full report with vLLM rows; a hand edit, or a new report without rewriting the README, fails here."""
    sys.path.insert(0, str(ROOT / "bench"))
    import headline

    assert (ROOT / "README.md").read_text() == headline.expected_readme()

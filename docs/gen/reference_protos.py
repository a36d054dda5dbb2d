"""reference/protos.md: every service, RPC, message and enum of protos/kvserve/v1/*.proto, with their comments.

Run by mkdocs-gen-files at build time. The .proto files are read as text (the generated *_pb2 modules carry no
comments): a comment block directly above a declaration documents it, as protoc takes it.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import mkdocs_gen_files

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ROOT / "protos" / "kvserve" / "v1"
PAGE = "reference/protos.md"

BLOCK = re.compile(r"^(service|message|enum|oneof)\s+(\w+)\s*\{\s*(\})?$")
RPC = re.compile(r"^rpc\s+(\w+)\s*\(\s*(stream\s+)?([\w.]+)\s*\)\s*returns\s*\(\s*(stream\s+)?([\w.]+)\s*\)\s*;$")
FIELD = re.compile(r"^(optional\s+|repeated\s+)?(map<[^>]+>|[\w.]+)\s+(\w+)\s*=\s*(\d+)\s*;$")
VALUE = re.compile(r"^(\w+)\s*=\s*(-?\d+)\s*;$")
RESERVED = re.compile(r"^reserved\s+(.+);$")


@dataclass
class Decl:
    kind: str  # service, message, enum, oneof, rpc, field, value, reserved
    name: str
    comment: list[str]
    detail: dict = field(default_factory=dict)
    items: list[Decl] = field(default_factory=list)


def parse(path: Path) -> tuple[list[str], list[Decl]]:
    """(the file's leading comment, its top-level declarations)."""
    top: list[Decl] = []
    stack: list[Decl] = []
    comment: list[str] = []
    head: list[str] | None = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("//"):
            comment.append(line[2:].removeprefix(" "))
            continue
        if head is None and (not line or line.startswith("syntax")):
            head, comment = comment, []
        if not line or line.split()[0] in ("syntax", "package", "import", "option"):
            comment = []
            continue
        if line == "}":
            stack.pop()
            continue
        decl = None
        if m := BLOCK.match(line):
            decl = Decl(m[1], m[2], comment)
            (stack[-1].items if stack else top).append(decl)
            if not m[3]:
                stack.append(decl)
        elif m := RPC.match(line):
            decl = Decl("rpc", m[1], comment, {"request": m[3], "response": m[5],
                                               "client_stream": bool(m[2]), "server_stream": bool(m[4])})
        elif stack and stack[-1].kind == "enum" and (m := VALUE.match(line)):
            decl = Decl("value", m[1], comment, {"number": m[2]})
        elif m := FIELD.match(line):
            decl = Decl("field", m[3], comment, {"label": (m[1] or "").strip(), "type": m[2], "number": m[4]})
        elif m := RESERVED.match(line):
            decl = Decl("reserved", m[1], comment)
        else:
            raise ValueError(f"{path.name}: cannot read {line!r}")
        if decl.kind not in ("service", "message", "enum", "oneof"):
            stack[-1].items.append(decl)
        comment = []
    return head or [], top


def inline(text: str) -> str:
    """Text for a table cell or a paragraph: '<' outside code spans escaped, '|' escaped."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(p if p.startswith("`") else p.replace("<", "&lt;") for p in parts).replace("|", "\\|")


def prose(lines: list[str]) -> list[str]:
    """A comment block as Markdown: paragraphs, and its indented lines (tables, diagrams) as a text block."""
    out: list[str] = []
    paragraph: list[str] = []
    code: list[str] = []

    def flush():
        if paragraph:
            out.extend([inline(" ".join(paragraph)), ""])
            paragraph.clear()
        if code:
            out.extend(["```text", *textwrap.dedent("\n".join(code)).splitlines(), "```", ""])
            code.clear()

    for line in lines:
        if line.startswith(" ") and (code or line.strip()):
            if paragraph:
                flush()
            code.append(line)
        elif not line.strip():
            flush()
        else:
            if code:
                flush()
            paragraph.append(line)
    flush()
    return out


def cell(lines: list[str]) -> str:
    return inline(" ".join(line.strip() for line in lines))


def type_ref(name: str, known: set[str]) -> str:
    if name.startswith("map<"):
        inner = [type_ref(t.strip(), known) for t in name[4:-1].split(",")]
        return f"map&lt;{', '.join(inner)}&gt;"
    short = name.removeprefix("kvserve.v1.")
    return f"[`{short}`](#{short})" if short in known else f"`{name}`"


def fields_table(decl: Decl, known: set[str]) -> list[str]:
    rows = ["| field | type | # | description |", "|---|---|---:|---|"]
    for item in decl.items:
        if item.kind == "oneof":
            note = f"One of `{item.name}`" + (f" ({cell(item.comment)})" if item.comment else "") + ": "
            for member in item.items:
                rows.append(f"| `{member.name}` | {type_ref(member.detail['type'], known)} | "
                            f"{member.detail['number']} | {note}{cell(member.comment)} |")
        elif item.kind == "field":
            label = f"{item.detail['label']} " if item.detail["label"] else ""
            rows.append(f"| `{item.name}` | {label}{type_ref(item.detail['type'], known)} | "
                        f"{item.detail['number']} | {cell(item.comment)} |")
    reserved = [item.name for item in decl.items if item.kind == "reserved"]
    out = rows if len(rows) > 2 else ["No fields."]
    if reserved:
        out = [*out, "", f"Reserved: {', '.join(f'`{r}`' for r in reserved)}."]
    return [*out, ""]


def render_service(service: Decl, known: set[str]) -> list[str]:
    out = [f"### `{service.name}` {{#{service.name}}}", "", *prose(service.comment),
           "| RPC | request | response |", "|---|---|---|"]
    for rpc in service.items:
        d = rpc.detail
        req = ("stream " if d["client_stream"] else "") + type_ref(d["request"], known)
        resp = ("stream " if d["server_stream"] else "") + type_ref(d["response"], known)
        out.append(f"| [`{rpc.name}`](#{service.name}.{rpc.name}) | {req} | {resp} |")
    out.append("")
    for rpc in service.items:
        out += [f"#### `{service.name}.{rpc.name}` {{#{service.name}.{rpc.name}}}", "", *prose(rpc.comment)]
    return out


def render_type(decl: Decl, known: set[str]) -> list[str]:
    out = [f"### `{decl.name}`{' (enum)' if decl.kind == 'enum' else ''} {{#{decl.name}}}", "", *prose(decl.comment)]
    if decl.kind == "enum":
        out += ["| value | # | description |", "|---|---:|---|"]
        out += [f"| `{v.name}` | {v.detail['number']} | {cell(v.comment)} |" for v in decl.items if v.kind == "value"]
        return [*out, ""]
    return out + fields_table(decl, known)


def render() -> str:
    files = {path: parse(path) for path in sorted(PROTOS.glob("*.proto"))}
    known = {d.name for _, decls in files.values() for d in decls if d.kind in ("message", "enum")}
    lines = ["# Protocol buffers", "",
             "Every gRPC service, RPC, message and enum of package `kvserve.v1`, generated from "
             "`protos/kvserve/v1/*.proto` and their comments when this site is built. `make protos` regenerates "
             "the Python modules from the same files.", ""]
    for path, (head, decls) in files.items():
        lines += [f"## `{path.name}`", "", *prose(head)]
        lines += [line for d in decls if d.kind == "service" for line in render_service(d, known)]
        lines += [line for d in decls if d.kind != "service" for line in render_type(d, known)]
    return "\n".join(lines)


with mkdocs_gen_files.open(PAGE, "w") as f:
    f.write(render())

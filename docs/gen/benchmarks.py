"""The benchmark pages: docs/benchmarks/*.md, with the newest results the benchmarks wrote put in at build time.

Run by mkdocs-gen-files. A marker line in a page under benchmarks/ is replaced:

    <!-- results: NAME -->   the newest bench/results/NAME-<date>.md ("report": <date>.md, "report-quick":
                             <date>-quick.md), its headings moved under the page's; its plots and its JSON are
                             copied beside the page (benchmarks/results/) and linked. A few NAMEs are drawn from
                             their JSON instead (RENDERERS).
    <!-- headlines -->       the headline figures, each read from the newest result it names (HEADLINES)
    <!-- machines -->        every page's newest result, its date and the machine it records

So every figure on these pages is the one a benchmark wrote: nothing is copied by hand.
"""

from __future__ import annotations

import json
import logging
import re
import statistics
from pathlib import Path

import mkdocs_gen_files

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
PAGES = ROOT / "docs" / "benchmarks"
MARKER = re.compile(r"^<!-- (results|headlines|machines)(?::\s*([\w-]+))? -->$", re.M)
DATE = r"(\d{4}-\d\d-\d\d)"
log = logging.getLogger("mkdocs.plugins.kvserve.benchmarks")  # a warning fails `mkdocs build --strict`


def stem_pattern(name: str) -> re.Pattern:
    if name == "report":
        return re.compile(rf"^{DATE}$")
    if name == "report-quick":
        return re.compile(rf"^{DATE}-quick$")
    return re.compile(rf"^{re.escape(name)}-{DATE}(?:-(\d+))?$")


def stems(name: str) -> list[str]:
    """The result stems of ``name`` (bench/results/<stem>.md or .json), oldest first."""
    pattern = stem_pattern(name)

    def order(stem: str) -> tuple[str, int]:
        m = pattern.match(stem)
        return m[1], int(m[2] or 0) if pattern.groups > 1 else 0

    return sorted({p.stem for p in RESULTS.iterdir() if p.suffix in (".md", ".json") and pattern.match(p.stem)},
                  key=order)


def newest(name: str) -> str | None:
    found = stems(name)
    return found[-1] if found else None


def newest_date(name: str) -> list[str]:
    """Every stem of the newest date (benchmarks that write one file per run, numbered)."""
    found = stems(name)
    date = stem_pattern(name).match(found[-1])[1] if found else None
    return [s for s in found if stem_pattern(name).match(s)[1] == date]


def load(stem: str) -> dict:
    path = RESULTS / f"{stem}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def machine(data: dict) -> str:
    """What a result records of its machine: the CPU model where it has one."""
    cpu = data.get("cpu") if isinstance(data.get("cpu"), dict) else {}
    box = data.get("machine") if isinstance(data.get("machine"), dict) else {}
    cores = cpu.get("cores") or box.get("cpus") or box.get("cores") or data.get("cpus") or data.get("cores")
    parts = [cpu.get("model") or "CPU model not recorded"]
    if cpu.get("flags"):
        parts.append(" ".join(cpu["flags"]))
    if cores:
        parts.append(f"{cores} cores")
    return ", ".join(parts) if data else "no JSON"


COPIED: set[str] = set()


def copy(path: Path) -> str:
    """Copies a result file (a plot, a JSON) into the site beside the benchmark pages; its link from a page there."""
    if path.name not in COPIED:
        with mkdocs_gen_files.open(f"benchmarks/results/{path.name}", "wb") as f:
            f.write(path.read_bytes())
        COPIED.add(path.name)
    return f"results/{path.name}"


def shift_headings(text: str, top: int = 3) -> str:
    """The result's headings, outside code fences, moved so that its first level is ``top``."""
    lines, fence, levels = text.splitlines(), False, []
    for line in lines:
        fence ^= line.startswith("```")
        if not fence and (m := re.match(r"^(#+) ", line)):
            levels.append(len(m[1]))
    shift = top - min(levels) if levels else 0
    out, fence = [], False
    for line in lines:
        fence ^= line.startswith("```")
        out.append("#" * shift + line if not fence and re.match(r"^#+ ", line) else line)
    return "\n".join(out)


def source_line(stems_: list[str]) -> str:
    """Which files a section comes from (the JSON copied beside the page and linked), their date and machine."""
    files = []
    for stem in stems_:
        md, data = RESULTS / f"{stem}.md", RESULTS / f"{stem}.json"
        links = [f"`{md.name}`"] if md.exists() else []
        links += [f"[`{data.name}`]({copy(data)})"] if data.exists() else []
        files.append(" and ".join(links))
    data = load(stems_[-1])
    date = str(data.get("date", "")) or re.search(DATE, stems_[-1])[1]
    return f"*From {', '.join(files)} in `bench/results/` ({date[:10]}; {machine(data)}).*"


def include(name: str) -> str:
    """The newest result of ``name``, as Markdown for a benchmark page."""
    if name in RENDERERS:
        return RENDERERS[name](name)
    stem = newest(name)
    if stem is None:
        log.warning("benchmarks: no result bench/results/%s-<date>.md", name)
        return "*No result yet.*"
    md = RESULTS / f"{stem}.md"
    text = shift_headings(md.read_text()) if md.exists() else ""

    def image(m: re.Match) -> str:  # a plot, linked to itself at full size
        path = RESULTS / m[2]
        return f"[![{m[1]}]({copy(path)})]({copy(path)})" if path.exists() else m[0]

    text = re.sub(r"!\[([^\]]*)\]\(([^)\s]+\.png)\)", image, text)
    plot = RESULTS / f"{stem}.png"
    if plot.exists() and plot.name not in text:
        text += f"\n\n[![{stem}]({copy(plot)})]({copy(plot)})"
    return f"{source_line([stem])}\n\n{text.strip()}\n"


# Results drawn from their JSON rather than included as written.


def throughput_ab(name: str) -> str:
    """bench/throughput_ab.py writes JSON only, one file per run: every round of the newest date's runs."""
    runs = newest_date(name)
    if not runs:
        log.warning("benchmarks: no result bench/results/%s-<date>.json", name)
        return "*No result yet.*"
    rows = ["| run | round | kvserve tok/s | HF continuous batching tok/s | ratio |", "|---|---:|---:|---:|---:|"]
    ratios = []
    for stem in runs:
        for i, r in enumerate(load(stem)["rounds"], 1):
            ratios.append(r["ratio"])
            rows.append(f"| `{stem}` | {i} | {r['kvserve_tok_s']:.1f} | {r['hf_generate_batch_tok_s']:.1f} | "
                        f"{r['ratio']:.2f}x |")
    summary = (f"Median of the {len(ratios)} rounds: **{statistics.median(ratios):.2f}x** "
               f"(range {min(ratios):.2f}-{max(ratios):.2f}x).")
    return "\n".join([source_line(runs), "", *rows, "", summary, ""])


KVMANAGER_COLUMNS = {"grpc": "no persistence", "grpc+log": "Redis call log (default)",
                     "grpc+log-own-core": "the same, own core", "grpc+log-echo": "floor: transport + log"}


def kvmanager_summary(name: str) -> str:
    """p50 of one StepPages call over gRPC per scenario, in the configurations that matter (the full table below)."""
    stem = newest("kvmanager")
    if stem is None:
        log.warning("benchmarks: no result bench/results/kvmanager-<date>.json")
        return "*No result yet.*"
    data = load(stem)
    p50 = {(r["scenario"], r["config"]): r["p50_ms"] for r in data["results"]}
    scenarios = list(dict.fromkeys(r["scenario"] for r in data["results"]))
    rows = ["| call | " + " | ".join(KVMANAGER_COLUMNS.values()) + " |", "|---|" + "---:|" * len(KVMANAGER_COLUMNS)]
    for s in scenarios:
        cells = [f"{p50[s, c]:.2f} ms" if (s, c) in p50 else "" for c in KVMANAGER_COLUMNS]
        rows.append(f"| {s} | " + " | ".join(cells) + " |")
    target = data.get("verdict", {}).get("target_p50_ms")
    note = f"Target: p50 under {target:g} ms with the call log on." if target else ""
    return "\n".join([source_line([stem]), "", *rows, "", note, ""])


def gpu_check(name: str) -> str:
    """bench/gpu_check.py writes one JSON: its sections, and any that failed."""
    stem = newest(name)
    if stem is None:
        return ("*No GPU check has been recorded yet: `bench/results/` holds no `gpu-check-<date>.json`. Until one "
                "is, no figure on this site comes from a GPU.*\n")
    data = load(stem)
    rows = ["| section | outcome | seconds |", "|---|---|---:|"]
    for section, seconds in data.get("section_s", {}).items():
        value = data.get(section)
        outcome = f"error: {value['error']}" if isinstance(value, dict) and "error" in value else "ran"
        rows.append(f"| {section} | {outcome.replace('|', '/')} | {seconds} |")
    return "\n".join([f"{source_line([stem])} Device: {data.get('device', 'not recorded')}.", "", *rows, "",
                      "```json", json.dumps(data, indent=1)[:20000], "```", ""])


RENDERERS = {"throughput-ab": throughput_ab, "kvmanager-summary": kvmanager_summary, "gpu-check": gpu_check}
RENDERERS_ONLY = {"kvmanager-summary"}  # a second view of a result another marker includes


# The headline figures on benchmarks/index.md: (result, what, how it is read from the result's JSON).


def x(value: float) -> str:
    return f"{value:.2f}x"


def pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def _gateway_p50(d: dict) -> str:
    rows = {r["scenario"]: r["p50_ms"] for r in d["results"] if r["config"] == "grpc+log"}
    return f"{rows['gateway']:.2f} ms / {rows['gateway: admits']:.2f} ms"


def _quant(d: dict) -> str:
    quality = next(r for r in d["quality"] if r["kv_dtype"] == "int8" and r["kv_scales"] == "token_head")
    memory = {(r["kv_dtype"], r["kv_scales"]): r["bytes_per_token_tensors"] for r in d["memory"]}
    return f"{quality['ppl_over_float32']:.4f}x / {x(memory['float32', ''] / memory['int8', 'token_head'])}"


def _long(d: dict) -> str:
    row = min(d["lengths"]["rows"], key=lambda r: abs(r["prompt_tokens"] - 7000))
    return f"{x(row['tpot_hf_over_kvserve'])} ({row['prompt_tokens']:,}-token prompt)"


def _sinks(d: dict) -> str:
    common = {r["config"]["name"]: r["common"]["mean_nll"] for r in d["runs"]}
    return f"{common['sinks'] - common['dense']:+.3f} / {common['window'] - common['dense']:+.3f} nats"


def _chaos(d: dict) -> str:
    phases = d["phases"]
    return (f"{sum(p['lost'] for p in phases)} lost, {sum(p['wrong'] for p in phases)} wrong of "
            f"{sum(p['requests'] for p in phases)} requests over {len(phases)} phases")


def _reserve(d: dict) -> str:
    at_10 = d["median"]["10"]
    return f"{at_10['before']['kv_wait_share_pct']:.1f}% → {at_10['after']['kv_wait_share_pct']:.2f}%"


HEADLINES = [
    ("report", "Mixed burst (24 requests), tok/s: kvserve / HF `generate()` one at a time",
     lambda d: x(d["throughput"]["kvserve"]["tokens_per_s"] / d["throughput"]["hf_generate"]["tokens_per_s"])),
    ("report", "Mixed burst, tok/s: kvserve / HF's continuous batching",
     lambda d: x(d["throughput"]["kvserve"]["tokens_per_s"] / d["throughput"]["hf_generate_batch"]["tokens_per_s"])),
    ("report", "The same burst through the OpenAI API: kvserve / vLLM bfloat16 (its best here) / vLLM float32",
     lambda d: " / ".join(x(d["peers"]["ratios"][n]["burst_throughput"]) for n in ("vllm_bf16", "vllm_fp32"))),
    ("report", "Prefix hits, TTFT: vLLM's / kvserve's (bfloat16 / float32)",
     lambda d: " / ".join(x(d["peers"]["ratios"][n]["prefix_hit_ttft"]) for n in ("vllm_bf16", "vllm_fp32"))),
    ("report", "Greedy completions of the burst identical to vLLM float32's",
     lambda d: f"{d['peers']['agreement']['vllm_fp32']['identical']} of {d['peers']['agreement']['vllm_fp32']['of']}"),
    ("throughput-ab", "The same, kvserve and HF alternated over rounds (median)",
     lambda runs: x(statistics.median(r["ratio"] for d in runs for r in d["rounds"]))),
    ("report", "32 concurrent requests through the stack / the worker's raw batched forward",
     lambda d: pct(d["concurrency"]["kvserve_over_raw_runner"])),
    ("report", "Prefix hits: TTFT of requests 2..10 / request 1's (2,000-token shared prompt)",
     lambda d: pct(d["prefix"]["kvserve_on"]["rest_over_first"])),
    ("report", "256 tokens with the KV cache / recomputing every token",
     lambda d: f"{d['kv_cache']['speedup_kvserve']:.1f}x"),
    ("worker", "Worker decode, kvserve / HF's forward, at batch 1 / 8 / 32",
     lambda d: " / ".join(x(r["ratio_kvserve_vs_hf"]) for r in d["decode"])),
    ("kvmanager", "The gateway's StepPages calls for 64 running requests, p50 (no admission / admitting)",
     _gateway_p50),
    ("snapshots", "The call that makes a snapshot due: inline / forked",
     lambda d: f"{d['results']['due_call_ratio_inline_over_forked']:.1f}x"),
    ("reserve-ahead", "Gateway's wait on the kvmanager at 10 ms steps, share of step time: before → reserve-ahead",
     _reserve),
    ("kvquant", "int8 KV with per-token scales: perplexity / float32's, tokens per byte / float32's", _quant),
    ("long", "Time per output token at long context, HF / kvserve", _long),
    ("roofline", "The CPU worker against this machine's limits: issue 41's targets met",
     lambda d: ", ".join(f"{t['name']} {'met' if t['met'] else 'missed'}" for t in d["targets"])),
    ("colocate", "One core taken by a busy process: kvserve up's default keeps, of its unloaded throughput",
     lambda d: x(d["rows"]["kvserve"]["loaded_over_unloaded"])),
    ("streaming", "Log-perplexity vs dense attention, 4 sinks + window / window alone (positions 1,024-8,191)",
     _sinks),
    ("http", "HTTP / gRPC throughput, mixed burst (median of rounds)", lambda d: f"{d['burst']['ratio_median']:.3f}"),
    ("chaos", "kill -9 of each part under load", _chaos),
    ("fuzz", "Malformed and extreme bodies at both APIs: 5xx or server errors / hangs / wrong answers",
     lambda d: f"{d['server_errors']} / {d['hangs']} / {d['wrong']} of {d['bodies']:,} bodies"),
]


def found(name: str) -> list[str]:
    """The stems a page section shows: the newest, or every run of the newest date for RENDERERS' results."""
    if name in RENDERERS:
        return newest_date(name)
    stem = newest(name)
    return [stem] if stem else []


def headlines() -> str:
    rows = ["| what | figure | from |", "|---|---|---|"]
    for name, what, read in HEADLINES:
        stems_ = found(name)
        try:
            figure = read([load(s) for s in stems_] if name in RENDERERS else load(stems_[-1]))
        except (KeyError, IndexError, StopIteration, TypeError, ValueError) as e:
            log.warning("benchmarks: headline %r: no %s in the newest %s result", what, e, name)
            continue
        date = re.search(DATE, stems_[-1])[1]
        rows.append(f"| {what} | **{figure}** | [{TITLES[name]}]({PAGE_OF[name]}), {date} |")
    return "\n".join(rows) + "\n"


def machines() -> str:
    rows = ["| page | newest result | date | machine it records |", "|---|---|---|---|"]
    for name, page in PAGE_OF.items():
        stems_ = found(name)
        if not stems_:
            rows.append(f"| [{TITLES[name]}]({page}) | none yet | | |")
            continue
        data = load(stems_[-1])
        date = str(data.get("date", "")) or re.search(DATE, stems_[-1])[1]
        files = ", ".join(f"`{s}`" for s in stems_)
        rows.append(f"| [{TITLES[name]}]({page}) | {files} | {date[:10]} | {machine(data)} |")
    return "\n".join(rows) + "\n"


def title(text: str) -> str:
    m = re.search(r"^# (.+)$", text, re.M)
    return m[1].strip() if m else ""


SOURCES = {path.name: path.read_text() for path in sorted(PAGES.glob("*.md"))}
INDEX_ORDER = re.findall(r"\]\(([\w-]+\.md)\)", SOURCES.get("index.md", ""))
# result name -> the page that shows it (in the order index.md lists the pages), and that page's title
PAGE_OF = {m[2]: page for page, text in SOURCES.items() for m in MARKER.finditer(text)
           if m[1] == "results" and m[2] not in RENDERERS_ONLY}
PAGE_OF = dict(sorted(PAGE_OF.items(), key=lambda kv: INDEX_ORDER.index(kv[1]) if kv[1] in INDEX_ORDER else 99))
PAGE_OF["fuzz"] = "../reliability.md"  # make fuzz writes that page itself (bench/fuzz_frontends.py)
TITLES = {name: title(SOURCES[page]) for name, page in PAGE_OF.items() if page in SOURCES}
TITLES["fuzz"] = title((PAGES.parent / "reliability.md").read_text())

for page, text in SOURCES.items():
    def replace(m: re.Match) -> str:
        return headlines() if m[1] == "headlines" else machines() if m[1] == "machines" else include(m[2])

    with mkdocs_gen_files.open(f"benchmarks/{page}", "w") as f:
        f.write(MARKER.sub(replace, text))

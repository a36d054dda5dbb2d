"""The chaos report as a Markdown table (bench/results/chaos-<date>.md)."""

from __future__ import annotations

RECOVERY_LABELS = (  # the fault's own figures, in the order they read best
    ("kvmanager_restarted_s", "kvmanager restarted"),
    ("kvmanager_answering_s", "kvmanager answering"),
    ("worker_restarted_s", "worker restarted"),
    ("victim_requests_done_s", "its requests done"),
    ("failover_s", "Sentinel failover"),
    ("redis_restarted_s", "Redis restarted"),
    ("worker_ready_s", "worker ready"),
    ("first_request_s", "first request on it (after ready)"),
    ("replacement_ready_s", "replacement worker ready"),
)


def _s(value) -> str:
    return "-" if value is None else f"{value:.1f} s"


def _details(phase: dict) -> str:
    rec, fig = phase.get("recovery", {}), phase.get("figures", {})
    parts = [f"{label} {_s(rec[key])}" for key, label in RECOVERY_LABELS if key in rec]
    if "victim_requests" in fig:
        parts.append(f"{fig['victim_requests']} requests on it")
    if "dead_pool_dropped" in fig:
        parts.append("its pool dropped" if fig["dead_pool_dropped"] else "its pool NOT dropped")
    if fig.get("steps_on_added_worker") is not None:
        parts.append(f"{fig['steps_on_added_worker']} steps on it")
    if phase.get("error"):
        parts.append(f"fault failed: {phase['error']}")
    return "; ".join(parts) or "-"


def markdown(report: dict) -> str:
    f = report["features"]
    cfg = report["config"]
    lines = [
        f"# Chaos run, {report['date']}",
        "",
        f"`{report['command']}`: {cfg['num_clients']} closed-loop greedy clients (max_tokens {cfg['max_tokens']}, "
        f"ignore_eos, streaming, {len(report['prompts'])} prompts), {report['kvmanagers']} kvmanager(s) on "
        f"{report['redis']}; workers: {report['workers_follow']} ({cfg['stack']['num_pages']} pages x "
        f"{cfg['stack']['page_size']} tokens each); gateway --worker-timeout {report['gateway_worker_timeout_s']:g}. "
        f"Wrong = token ids differing from {report['reference']['source']}. Pages left = used pages on the live "
        "pools once the phase's load drained. Recovery times are from the kill.",
        "",
        f"Build features: membership {f['membership']}, standby {f['standby']}, sentinel {f['sentinel']}, "
        f"declare_dead {f['declare_dead']}; kvserve at {report.get('kvserve_commit') or '?'}. Stack start "
        f"{report['stack_start_s']:.0f} s, whole run {report['total_s']:.0f} s.",
        "",
        "| | fault | requests | completed | lost | wrong | pages left | first completion after the fault | "
        "first new request done | recovery |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for p in report["phases"]:
        if not p["ran"]:
            lines.append(f"| {p['key']} | {p['name']}: not run ({p['skipped']}) | | | | | | | | |")
            continue
        rec = p["recovery"]
        lines.append(f"| {p['key']} | {p['fault']} | {p['requests']} | {p['completed']} | {p['lost']} | "
                     f"{p['wrong']} | {p['pages_left_total']} | {_s(rec.get('first_completion_s'))} | "
                     f"{_s(rec.get('first_new_request_completed_s'))} | {_details(p)} |")
    errors = [(p["key"], e) for p in report["phases"] if p["ran"] for e in p["errors"]]
    if errors:
        lines += ["", "Errors of lost requests (first few per phase):", ""]
        lines += [f"- {key}: `{e[:300]}`" for key, e in errors]
    return "\n".join(lines) + "\n"

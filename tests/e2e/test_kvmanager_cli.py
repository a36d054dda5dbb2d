"""`kvserve kvmanager` and `kvserve admin` as real processes: ready line, admin commands, SIGTERM, embedded Redis."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from kvmanager_processes import P1, cli_env, kvmanager_process, populate, run_cli, stop_cleanly
from service_process import KVSERVE


def test_kvmanager_serves_admin_commands_then_exits_cleanly(tmp_path):
    from kvmanager_rpc import write_word_tokenizer

    tok_dir = write_word_tokenizer(tmp_path / "tok")
    with kvmanager_process(tmp_path, "--no-persistence", "--admin-token", "T", "--model", str(tok_dir)) as (proc, m):
        assert m.group(2) == "none, --no-persistence" and "--admin-token" in m.group(3)
        port = m.group(1)
        populate(int(port))
        admin = ("--kvmanager", f"127.0.0.1:{port}", "--admin-token", "T")

        out = run_cli(tmp_path, "admin", "stats", "--json", *admin)
        assert out.returncode == 0, out.stderr
        stats = json.loads(out.stdout)
        (pool,) = stats["pools"]
        assert (pool["worker_id"], pool["num_used_pages"], pool["num_cached_pages"], pool["num_free_pages"]) == (
            "w0", 2, 3, 3)
        assert pool["pool_bytes"] == 3200 and stats["prefix_cache_queries"] == 18  # counts are numbers, int64 too
        assert pool["epoch"] == 1 and stats["store_ok"] is True
        assert (pool["sliding_window"], pool["attention_sinks"], pool["num_window_released_pages"]) == (0, 0, 0)
        assert [(t["tenant"], t["num_blocks"], t["num_requests"]) for t in stats["tenants"]] == [("A", 3, 0),
                                                                                              ("B", 0, 1)]
        out = run_cli(tmp_path, "admin", "stats", *admin)
        assert out.returncode == 0, out.stderr
        rows = [line.split() for line in out.stdout.splitlines()]
        assert rows[1][:12] == ["WORKER", "EPOCH", "ROLE", "KV_DTYPE", "KV_SCALES", "PAGE_SIZE", "PAGES", "USED",
                                "CACHED", "FREE", "PINNED", "REQUESTS"]
        assert rows[1][15:] == ["WINDOW", "SINKS", "WINDOW_RELEASED"]
        assert rows[2] == ["w0", "1", "both", "float32", "-", "4", "8", "2", "3", "3", "0", "1", "3200", "800", "1200",
                           "-", "-", "0"]
        assert "prefix cache: 0 of 18 query tokens hit (0.0%), 0 blocks evicted, store ok" in out.stdout

        out = run_cli(tmp_path, "admin", "probe", "A", "--tokens", ",".join(map(str, P1 + [7])), *admin)
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines()[0] == "tenant A: 12 of 13 tokens hit (best: w0)"
        assert out.stdout.splitlines()[2].split() == ["w0", "1", "12"]
        out = run_cli(tmp_path, "admin", "pin", "A", "--tokens", ",".join(map(str, P1)), *admin)
        assert out.stdout.strip() == "pinned 3 blocks of tenant A (12 tokens on the best pool)", out.stderr
        out = run_cli(tmp_path, "admin", "pin", "A", "--tokens", "1,2,3,4", *admin)  # nothing cached
        assert out.returncode == 0 and "pinned 0 blocks" in out.stdout and "pin it after a request has cached it" in (
            out.stdout)
        assert run_cli(tmp_path, "admin", "unpin", "A", "--tokens", ",".join(map(str, P1)), *admin).stdout.strip() == (
            "unpinned 3 blocks of tenant A")
        out = run_cli(tmp_path, "admin", "probe", "A", "--text", "the cat sat on", "--json", *admin)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["num_query_tokens"] == 4  # tokenised by the kvmanager's --model

        for args, code, message in ((("stats", "--kvmanager", f"127.0.0.1:{port}", "--admin-token", "wrong"), 1,
                                     "kvserve: PERMISSION_DENIED: wrong admin token"),
                                    (("inspect", "nobody", *admin), 1, "kvserve: NOT_FOUND: tenant 'nobody'"),
                                    (("reset", *admin), 2, "confirm with --yes"),
                                    (("probe", "A", "--tokens", "1,x", *admin), 2, "not a comma-separated list"),
                                    (("probe", "A", "--tokens", "99999999999", *admin), 2,
                                     "token id 99999999999 is not a uint32")):
            out = run_cli(tmp_path, "admin", *args)
            assert (out.returncode, out.stdout) == (code, ""), out.stderr
            assert message in out.stderr and "Traceback" not in out.stderr
        read_end, write_end = os.pipe()
        os.close(read_end)  # `kvserve admin stats | head` after head has left: stdout is a pipe nobody reads
        try:
            out = subprocess.run([KVSERVE, "admin", "stats", *admin], stdout=write_end, stderr=subprocess.PIPE,
                                 text=True, env=cli_env(tmp_path), timeout=60, stdin=subprocess.DEVNULL)
        finally:
            os.close(write_end)
        assert out.returncode == 141 and "Traceback" not in out.stderr, out.stderr

        out = run_cli(tmp_path, "admin", "forget-worker", "w0", *admin)
        assert out.returncode == 1 and "FAILED_PRECONDITION: 1 requests are running on worker 'w0'" in out.stderr
        out = run_cli(tmp_path, "admin", "forget-worker", "w0", "--force", *admin)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "forgot worker w0: dropped its pool, 1 requests and 3 cached blocks"
        out = run_cli(tmp_path, "admin", "stats", "--json", *admin)
        assert json.loads(out.stdout)["pools"] == []
        stop_cleanly(proc)


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                kids.append(int(stat.parent.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_kvmanager_with_embedded_redis_persists_and_stops_its_redis(tmp_path):
    data_dir = tmp_path / "data"
    with kvmanager_process(tmp_path, "--data-dir", str(data_dir)) as (proc, m):
        assert re.fullmatch(r"redis://127\.0\.0\.1:\d+/0", m.group(2)) and m.group(3) == str(data_dir / "admin_token")
        assert (data_dir / "admin_token").stat().st_mode & 0o777 == 0o600
        redis_pids = _children(proc.pid)
        assert len(redis_pids) == 1 and _alive(redis_pids[0])
        populate(int(m.group(1)))
        stop_cleanly(proc)
        assert not _alive(redis_pids[0]), "the embedded redis-server outlived the kvmanager"
    with kvmanager_process(tmp_path, "--data-dir", str(data_dir)) as (proc, m):  # restart: the state is back
        out = run_cli(tmp_path, "admin", "tenants", "--json", "--kvmanager", f"127.0.0.1:{m.group(1)}",
                      "--data-dir", str(data_dir))  # the token from the new admin_token file
        assert out.returncode == 0, out.stderr
        assert [(t["tenant"], t["num_blocks"]) for t in json.loads(out.stdout)["tenants"]] == [("A", 3), ("B", 0)]
        stop_cleanly(proc)


def test_a_second_kvmanager_on_the_same_data_dir_or_port_exits_and_leaves_the_first_alone(tmp_path):
    """It would start a second Redis on the same files and overwrite the admin token the first one checks."""
    data_dir = tmp_path / "data"
    with kvmanager_process(tmp_path, "--data-dir", str(data_dir)) as (proc, m):
        port, token = m.group(1), (data_dir / "admin_token").read_text()
        redis_pids = _children(proc.pid)
        same_dir = run_cli(tmp_path, "kvmanager", "--data-dir", str(data_dir), "--port", "0")
        assert same_dir.returncode == 2 and "ready" not in same_dir.stdout
        assert (f"the data directory {data_dir} is in use by another kvmanager (pid {proc.pid})"
                in same_dir.stderr)
        same_port = run_cli(tmp_path, "kvmanager", "--no-persistence", "--admin-token", "T", "--port", port)
        assert same_port.returncode == 1 and "ready" not in same_port.stdout
        assert f"could not bind 127.0.0.1:{port}" in same_port.stderr and "Traceback" not in same_port.stderr
        assert (data_dir / "admin_token").read_text() == token and _children(proc.pid) == redis_pids
        out = run_cli(tmp_path, "admin", "stats", "--kvmanager", f"127.0.0.1:{port}", "--data-dir", str(data_dir))
        assert out.returncode == 0, out.stderr
        stop_cleanly(proc)


def test_kvmanager_snapshots_in_a_forked_child_and_restarts_from_it(tmp_path, monkeypatch):
    """With a snapshot due every 2 calls, the real process forks inside its gRPC handlers. It sets
    GRPC_ENABLE_FORK_SUPPORT=0 itself (removed from the environment here), so no child crashes; a graceful
    stop lets a writing child finish, and the restart loads the child's generation."""
    from kvserve.common.redis_client import connect

    monkeypatch.delenv("GRPC_ENABLE_FORK_SUPPORT", raising=False)  # conftest's: the kvmanager must set it
    data_dir = tmp_path / "data"
    args = ("--data-dir", str(data_dir), "--snapshot-every", "2")
    with kvmanager_process(tmp_path, *args) as (proc, m):
        populate(int(m.group(1)))  # a registration and 3 steps: snapshots are due at the 2nd and 4th calls
        stop_cleanly(proc)
    stderr = (tmp_path / "kvmanager.stderr").read_text()
    assert "snapshot child" not in stderr and "Fatal Python error" not in stderr, stderr
    with kvmanager_process(tmp_path, *args) as (proc, m):
        client = connect(m.group(2))
        gen = int(client.get("kvserve:gen"))
        assert gen > 0 and client.exists(f"kvserve:snap:{gen}") and not client.exists("kvserve:log:0")
        out = run_cli(tmp_path, "admin", "stats", "--json", "--kvmanager", f"127.0.0.1:{m.group(1)}",
                      "--data-dir", str(data_dir))
        assert out.returncode == 0, out.stderr
        (pool,) = json.loads(out.stdout)["pools"]
        assert (pool["num_used_pages"], pool["num_cached_pages"], pool["num_free_pages"]) == (2, 3, 3)
        stop_cleanly(proc)


@pytest.mark.parametrize("args,message", [
    (["--model", "/nonexistent"], "no tokenizer.json"),
    (["--port", "many"], "argument --port: invalid int value"),
    (["--snapshot-every", "0"], "argument --snapshot-every: must be positive, got 0"),
])
def test_bad_kvmanager_flags_exit_2(tmp_path, args, message):
    out = run_cli(tmp_path, "kvmanager", "--no-persistence", "--admin-token", "T", "--port", "0", *args)
    assert out.returncode == 2 and message in out.stderr and "ready" not in out.stdout

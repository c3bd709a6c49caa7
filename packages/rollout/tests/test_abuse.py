"""The rollout server's abuse suite: every attack of rollout_abuse.py against one
`rlhf-rollout serve` subprocess (vLLM on CPU, the tiny test model), while a well-behaved client
keeps calling. Throughout: health and normal calls answer within their deadlines, memory stays
bounded; after each attack the server is idle again within seconds; SIGTERM stops it within
seconds however much is in flight, and leaves no process behind."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ferrule_testkit import tiny_model
from ferrule_testkit.watch import rss, tree

sys.path.insert(0, str(Path(__file__).parent))
import rollout_abuse as abuse

pytestmark = pytest.mark.soak
TOKEN = "rollout-abuse-token-0123456789abcdef"
RSS_GROWTH_BOUND = 600 << 20  # over the tree's memory once serving (+1.2 GB per huge prompt)
STOP_WITHIN = 10.0
GRACE = 5.0  # rlhf-rollout serve's for calls other than generation


def test_no_request_freezes_starves_or_bloats_the_rollout_server(vllm_cpu_env, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    args = [sys.executable, "-m", "ferrule_rollout", "serve", "--model", str(tiny_model("qwen2"))]
    args += ["--bind", "127.0.0.1:0", "--dtype", "float32", "--max-model-len", "256"]
    args += ["--token-file", str(token_file)]
    args += ["--max-request-sequences", "256", "--max-sequences-in-flight", "600"]
    server = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ
    )
    try:
        for line in server.stdout:
            if line.startswith("rlhf-rollout: serving"):
                break
        else:
            pytest.fail("the server exited before serving")
        address = line.rsplit(" on ", 1)[1].strip()
        threading.Thread(target=lambda: [None for _ in server.stdout], daemon=True).start()
        abuse.warm_up(address, TOKEN)
        ready_rss = sum(map(rss, tree(server.pid)))
        rows, watch = abuse.run_all(server.pid, address, TOKEN)
        failures = []
        for row in rows:
            name = row["attack"]
            print(row)
            if row["answered"] != row["sent"]:
                failures.append(f"{name}: {row['answered']} of {row['sent']} answered correctly")
            if row["idle_after_s"] is None:
                failures.append(f"{name}: still busy {abuse.IDLE_WITHIN} s after the attack")
            failures += [f"{name}: health: {f}" for f in row["health_failures"]]
            failures += [f"{name}: normal call: {f}" for f in row["normal_failures"]]
        assert not failures, "\n".join(failures)
        assert watch.normal_s and watch.health_ms
        growth = watch.peak_tree_rss - ready_rss
        print({"ready_rss_mb": ready_rss >> 20, "peak_growth_mb": growth >> 20})
        assert growth < RSS_GROWTH_BOUND, growth >> 20
        # SIGTERM with 512 sequences in flight (it took over 10 s with 291k admitted): the
        # calls end at once, UNAVAILABLE, not after the 5 s grace.
        cut = {}

        def flood_then_note_the_end():
            cut["outcome"] = abuse.flood_cut_by_shutdown(address, TOKEN)
            cut["ended"] = time.monotonic()

        flood = threading.Thread(target=flood_then_note_the_end)
        flood.start()
        time.sleep(1.0)
        stopping = time.monotonic()
        server.terminate()
        assert server.wait(STOP_WITHIN + 5) == 0
        stopped = time.monotonic() - stopping
        flood.join(30)
        calls_ended = cut["ended"] - stopping
        print({"sigterm_to_exit_s": round(stopped, 2), "calls_ended_s": round(calls_ended, 2)})
        assert stopped < STOP_WITHIN
        answered, sent = cut["outcome"]
        assert answered == sent, f"{sent - answered} of {sent} calls served or failed otherwise"
        assert calls_ended < GRACE, calls_ended
        time.sleep(0.5)
        left = [pid for pid in watch.seen if pid != server.pid and _running(pid)]
        assert not left, f"processes left behind: {left}"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

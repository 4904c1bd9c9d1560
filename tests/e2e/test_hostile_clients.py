"""The server as `make serve` starts it keeps answering while a crowd of hostile connections holds
on: a thousand that send nothing, fifty whose body comes one byte a second, and two streaming chats
whose client never reads (bench/hostile_clients.py, smaller and shorter: 4 s). With Waitress's default
connection limit of 100 the first /health after such a crowd times out."""

from __future__ import annotations

import resource
import sys

from support import ROOT
from support.tiny_models import write_tiny_gguf

sys.path.insert(0, str(ROOT / "bench"))
import hostile_clients  # noqa: E402
from servers import start_ours  # noqa: E402

CROWD = {"idle": 1000, "slow bodies": 50, "unread": 2}


def test_a_crowd_of_idle_slow_and_unread_connections_does_not_stop_the_good_clients(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))  # this client holds every socket too
    try:
        model = write_tiny_gguf(str(tmp_path / "tiny.gguf"), "llama", context=256)
        with start_ours(model=model, env={"LLM_LOG_LEVEL": "warning"}, timeout=300) as ours:
            report = hostile_clients.run(ours.port, CROWD["idle"], CROWD["slow bodies"], CROWD["unread"], seconds=4)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert report["opened"] == report["held"] == CROWD, report
    assert report["settled"][1] == 200, report
    for what in ("/health", "/admin", "chat"):
        assert report[what]["requests"] > 0 and report[what]["failed"] == 0, report
        # a liveness bound, far above what a good client sees (bench/RESULTS.md has the figures)
        assert report[what]["max"] < 5, report

"""Two real replicas behind a real nginx, on loopback (`make test-deploy`; minutes, not in `make test`).

Two `waitress-serve wsgi:app` processes serve a tiny random-weight GGUF (tests/support/tiny_models.py);
Debian's nginx runs deploy/nginx/tinyserve.conf in front of them, changed only in its listen port
and log path. Clients are the real `openai` package, without retries: whatever nginx answers is
what a user would see. Which replica served what, after which retries, comes from nginx's own
access log (the config's `tinyserve_upstream` format). The tests run in file order:

1. sessions: 5 conversations of 10 turns, each with its `X-Session-Id`, stay on one replica and every
   follow-up turn reuses the cache; 20 requests without a key spread over both replicas;
2. a full queue: one replica's slots and queue are taken by direct streams; requests through nginx
   get that replica's 429, are retried on the other, and every client gets a 200;
3. SIGTERM: one replica is stopped mid-load; its streams finish, it exits 0, new requests go to the
   other, and every request's outcome is counted: no connection error, no 502, nothing lost.

Each test prints its counts; with `-s` they show in the run's output.
"""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from support.tiny_models import write_tiny_gguf

ROOT = Path(__file__).resolve().parents[2]
SLOTS, QUEUE_LIMIT, CONTEXT = 8, 4, 1024
START_TIMEOUT_S = 900  # two replicas compiling their kernels at once on a busy 2-core machine
SESSIONS, TURNS, UNKEYED = 5, 10, 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
    except OSError:
        return 0, {}


class Replica:
    def __init__(self, name: str, model: Path, logs: Path):
        self.name, self.port = name, free_port()
        self.addr, self.url = f"127.0.0.1:{self.port}", f"http://127.0.0.1:{self.port}"
        self.log = logs / f"{name}.log"
        env = {
            **os.environ,
            "DEV": "CPU",
            "HCQ2": "1",
            "LLM_MODEL": str(model),
            "LLM_MAX_CONTEXT": str(CONTEXT),
            "LLM_SLOTS": str(SLOTS),
            "LLM_QUEUE_LIMIT": str(QUEUE_LIMIT),
            "LLM_DRAIN_SECONDS": "120",
        }
        threads = SLOTS + QUEUE_LIMIT + 16
        argv = [
            str(Path(sys.executable).parent / "waitress-serve"),
            f"--threads={threads}",
            "--channel-request-lookahead=1",
            f"--listen={self.addr}",
            "wsgi:app",
        ]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def nginx_bin() -> str:
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
    if not found:
        pytest.skip("Debian's nginx is not installed: `make test-deploy` installs it when run as root (apt-get install nginx)")
    return found


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, nginx_bin):
    where = tmp_path_factory.mktemp("replicas")
    model = Path(write_tiny_gguf(str(where / "tiny.gguf"), context=CONTEXT))
    started = [Replica("a", model, where), Replica("b", model, where)]
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        for r in started:
            while health(r.url)[0] != 200:
                assert r.proc.poll() is None, f"replica {r.name} exited:\n{r.log.read_text()[-3000:]}"
                assert time.monotonic() < deadline, f"replica {r.name} not ready:\n{r.log.read_text()[-3000:]}"
                time.sleep(1)
        yield started
    finally:
        for r in started:
            r.stop()


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, nginx_bin, replicas):
    where = tmp_path_factory.mktemp("nginx")
    port = free_port()
    conf = (ROOT / "deploy" / "nginx" / "tinyserve.conf").read_text()
    assert conf.count("listen 8080;") == 1 and conf.count("/var/log/nginx/") == 1
    conf = conf.replace("listen 8080;", f"listen 127.0.0.1:{port};").replace("/var/log/nginx/", f"{where}/")
    (where / "tinyserve.conf").write_text(conf)
    (where / "tinyserve-replicas.conf").write_text("".join(f"server {r.addr} max_fails=0;\n" for r in replicas))
    (where / "nginx.conf").write_text(
        f"daemon off;\nworker_processes 1;\npid {where}/nginx.pid;\nerror_log {where}/error.log;\n"
        "events { worker_connections 512; }\nhttp { include tinyserve.conf; }\n"
    )
    proc = subprocess.Popen([nginx_bin, "-p", str(where), "-c", str(where / "nginx.conf")], stderr=subprocess.PIPE)
    try:
        for _ in range(100):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.1)
        yield Proxy(f"http://127.0.0.1:{port}", where / "tinyserve.log", replicas)
    finally:
        proc.send_signal(signal.SIGQUIT)  # nginx's graceful stop
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


LOG_LINE = re.compile(
    r'"(?P<request>[^"]*)" (?P<status>\d+) session="(?P<session>[^"]*)" upstream="(?P<upstream>[^"]*)" upstream_status="(?P<upstream_status>[^"]*)"'
)


class Proxy:
    def __init__(self, url: str, log: Path, replicas: list[Replica]):
        self.url, self.log, self.replicas = url, log, replicas
        self.names = {r.addr: r.name for r in replicas}

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=300)

    def lines(self) -> list[dict]:
        """nginx's access-log entries for the API so far, upstreams named by replica ("a", "b")."""
        out = []
        for line in self.log.read_text().splitlines():
            m = LOG_LINE.search(line)
            if m and "/v1/" in m["request"]:
                d = m.groupdict()
                d["session"] = "" if d["session"] == "-" else d["session"]  # nginx logs an empty value as "-"
                d["upstreams"] = [self.names.get(u.strip(), u.strip()) for u in d["upstream"].split(",")]
                d["statuses"] = [s.strip() for s in d["upstream_status"].split(",")]
                out.append(d)
        return out


def chat(client, messages, session=None, max_tokens=8, **kw):
    headers = {"X-Session-Id": session} if session else {}
    return client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=max_tokens, temperature=0, extra_headers=headers, **kw
    )


# --- 1. session affinity ------------------------------------------------------------------------------


def test_a_session_stays_on_its_replica_and_reuses_the_cache(proxy):
    client = proxy.client()
    cached: dict[str, list[int]] = collections.defaultdict(list)
    failures: list[str] = []

    def converse(session: str) -> None:
        messages = [{"role": "system", "content": f"You are assistant {session}."}]
        for turn in range(TURNS):
            messages.append({"role": "user", "content": f"Turn {turn} of {session}: tell me more."})
            try:
                reply = chat(client, messages, session)
            except Exception as e:  # counted, then asserted on below
                failures.append(f"{session} turn {turn}: {e!r}")
                return
            cached[session].append(reply.usage.prompt_tokens_details.cached_tokens)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})

    sessions = [f"session-{i}" for i in range(SESSIONS)]
    threads = [threading.Thread(target=converse, args=(s,)) for s in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    keyed = [d for d in proxy.lines() if d["session"]]
    served = {s: sorted({d["upstreams"][-1] for d in keyed if d["session"] == s}) for s in sessions}

    def unkeyed(i: int) -> str:
        return chat(client, [{"role": "user", "content": f"One question, number {i}."}], max_tokens=24).choices[0].finish_reason

    with_key = len(keyed)
    results: list[str] = []
    pool = [threading.Thread(target=lambda i=i: results.append(unkeyed(i))) for i in range(UNKEYED)]
    for batch in range(0, UNKEYED, 4):  # four at a time: least_conn sees the others still open
        for t in pool[batch : batch + 4]:
            t.start()
        for t in pool[batch : batch + 4]:
            t.join(timeout=300)
    plain = [d for d in proxy.lines() if not d["session"]]
    spread = collections.Counter(d["upstreams"][-1] for d in plain)
    print(f"\n[sessions] {with_key} keyed requests; replica per session: {served}; cached tokens per turn: {dict(cached)}")
    print(
        f"[sessions] {len(plain)} requests without a key: served by {dict(spread)}; statuses {collections.Counter(d['status'] for d in plain)}"
    )
    client.close()

    assert not failures, failures
    assert with_key == SESSIONS * TURNS and all(d["status"] == "200" for d in keyed)
    assert all(len(r) == 1 for r in served.values()), served
    for session, counts in cached.items():
        assert len(counts) == TURNS and all(c > 0 for c in counts[1:]), (session, counts)
    assert len(results) == UNKEYED and len(plain) == UNKEYED
    assert set(spread) == {"a", "b"}, spread
    proxy.affinity = served


# --- 2. a full queue ------------------------------------------------------------------------------------


def test_a_full_queue_sends_requests_to_the_other_replica(proxy):
    full, other = proxy.replicas
    keyed_to_full = [s for s, r in getattr(proxy, "affinity", {}).items() if r == [full.name]]
    direct = openai.OpenAI(base_url=full.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    streams, errors = [], []

    def hold(i: int) -> None:
        try:
            stream = chat(
                direct,
                [{"role": "user", "content": f"Long answer {i}"}],
                max_tokens=CONTEXT - 64,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            streams.append(stream)
            for _ in stream:
                pass
        except Exception as e:  # the test closes these streams under the reading thread
            errors.append(repr(e))

    def taken() -> int:
        h = health(full.url)[1]
        return h.get("running", 0) + h.get("queue_depth", 0)

    # One at a time: requests arriving together all count as waiting before any is admitted.
    holders = [threading.Thread(target=hold, args=(i,), daemon=True) for i in range(SLOTS + QUEUE_LIMIT)]
    for i, t in enumerate(holders):
        t.start()
        deadline = time.monotonic() + 60
        while taken() <= i:
            assert time.monotonic() < deadline and not errors, (health(full.url), errors)
            time.sleep(0.1)
    assert health(full.url)[1].get("queue_depth") == QUEUE_LIMIT, health(full.url)
    before = len(proxy.lines())
    client = proxy.client()
    outcomes = collections.Counter()
    for i in range(6):
        session = keyed_to_full[i % len(keyed_to_full)] if keyed_to_full and i % 2 == 0 else None
        try:
            chat(client, [{"role": "user", "content": f"While {full.name} is full, {i}"}], session)
            outcomes["200"] += 1
        except openai.APIStatusError as e:
            outcomes[str(e.status_code)] += 1
        except openai.APIConnectionError:
            outcomes["connection error"] += 1
    still_full = health(full.url)[1]
    deadline = time.monotonic() + 120
    while any(t.is_alive() for t in holders) and time.monotonic() < deadline:
        for stream in list(streams):  # queued streams start once the running ones let go
            stream.close()
        time.sleep(0.2)
    client.close()
    direct.close()
    lines = proxy.lines()[before:]
    paths = collections.Counter(" -> ".join(f"{u}:{s}" for u, s in zip(d["upstreams"], d["statuses"])) for d in lines)
    print(
        f"\n[queue full] {full.name} held {SLOTS} running + {QUEUE_LIMIT} queued; 6 requests through nginx: clients saw {dict(outcomes)}; upstream paths {dict(paths)}"
    )

    assert still_full.get("queue_depth") == QUEUE_LIMIT, still_full  # the queue stayed full throughout
    assert outcomes == {"200": 6}
    assert all(d["upstreams"][-1] == other.name and d["statuses"][-1] == "200" for d in lines)
    assert paths[f"{full.name}:429 -> {other.name}:200"] >= 1, paths  # nginx tried the full one and moved on
    assert not any(t.is_alive() for t in holders)


# --- 3. SIGTERM mid-load ----------------------------------------------------------------------------------


def test_sigterm_drains_one_replica_while_the_other_takes_over(proxy):
    stopping, staying = proxy.replicas
    client = proxy.client()
    outcomes = collections.Counter()
    finish = collections.Counter()
    stop = threading.Event()
    lock = threading.Lock()
    sent = 0

    def load(worker: int) -> None:
        nonlocal sent
        n = 0
        while not stop.is_set():
            n += 1
            with lock:
                sent += 1
            try:
                stream = chat(
                    client,
                    [{"role": "user", "content": f"Worker {worker} request {n}"}],
                    max_tokens=48,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                reasons = [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason]
                outcome = "completed" if reasons == ["length"] else f"ended without a finish: {reasons}"
                with lock:
                    finish.update(reasons)
            except openai.APIStatusError as e:
                outcome = f"HTTP {e.status_code}"
            except openai.APIConnectionError as e:
                outcome = f"connection error: {e!r}"
            except Exception as e:  # a broken stream mid-way, for instance
                outcome = f"failed: {e!r}"
            with lock:
                outcomes[outcome] += 1

    before = len(proxy.lines())
    workers = [threading.Thread(target=load, args=(i,)) for i in range(6)]
    for t in workers:
        t.start()
    time.sleep(8)
    in_flight = health(stopping.url)[1].get("running")
    signalled = time.monotonic()
    stopping.proc.send_signal(signal.SIGTERM)
    code = stopping.proc.wait(timeout=180)
    drained_in = time.monotonic() - signalled
    time.sleep(5)  # more requests, all to the remaining replica
    stop.set()
    for t in workers:
        t.join(timeout=300)
    client.close()
    lines = proxy.lines()[before:]
    served = collections.Counter(d["upstreams"][-1] for d in lines)
    retried = collections.Counter(
        " -> ".join(f"{u}:{s}" for u, s in zip(d["upstreams"], d["statuses"])) for d in lines if len(d["upstreams"]) > 1
    )
    log = stopping.log.read_text()
    print(
        f"\n[sigterm] {sent} requests sent; outcomes {dict(outcomes)}; {stopping.name} had {in_flight} running at SIGTERM, "
        f"drained and exited {code} in {drained_in:.1f} s; served by {dict(served)}; retried {dict(retried)}; nginx statuses "
        f"{dict(collections.Counter(d['status'] for d in lines))}"
    )

    assert code == 0
    assert outcomes == {"completed": sent}, outcomes
    assert len(lines) == sent and all(d["status"] == "200" for d in lines)
    assert in_flight and "'cancelled': 0" in log and "'unfinished': 0" in log
    after = [d for d in lines if d["upstreams"][0] == stopping.name and d["statuses"][0] != "200"]
    assert all(d["upstreams"][-1] == staying.name for d in after)
    assert served[staying.name] > 0

"""What Waitress was started with, and whether that can serve this app's load.

Contract:
- `waitress_adjustments(argv)` parses a `waitress-serve` command line with Waitress's own parser
  and returns its effective `Adjustments` (defaults included), or None when `argv` is not
  `waitress-serve`'s (a test, another server) or Waitress would reject it anyway.
- `threads_needed(config)` is the pool this app needs: every streaming request holds one Waitress
  thread for its whole length, so the most requests running at once (LLM_MAX_BATCH on a paged KV
  cache, LLM_SLOTS on slots: the larger) + LLM_QUEUE_LIMIT threads can be taken by accepted
  requests, plus `HEADROOM_THREADS` for `/health`, `/metrics`, `/admin` and the 429s of a full queue.
- Connections: Waitress stops accepting new ones once `--connection-limit` (100 by default) are
  open, and an idle socket counts as much as a busy one, so a hundred clients that connect and send
  nothing (a slowloris, or keep-alive clients gone quiet) would leave `/health` unreachable until
  `--channel-timeout` closes them. Open connections cost a file descriptor each and no thread
  (Waitress reads a whole request before a thread sees it), so the limit is set high
  (`MIN_CONNECTIONS`), watched with poll() (select() cannot watch a descriptor above 1023), and
  `allow_connections(adjustments)` raises the process's open-file limit to cover them.
- `missing_flags(config, adjustments)` lists the exact flags to add; `warn_if_underprovisioned`
  logs them as one loud warning at start-up (`wsgi.py`) and returns them.

Why it matters, as measured: the plain `waitress-serve wsgi:app` runs 4 threads. With 6 streams open,
`/health` waited for a stream to end before it answered, and nothing in the log said why
(bench/RESULTS.md, replicas behind nginx). Without `--channel-request-lookahead`
Waitress stops reading a connection while its request runs, so a non-streaming client that hangs up
is never noticed and its request generates to `max_tokens` in a slot nobody reads.
"""

from __future__ import annotations

import getopt
import logging
import os

from webapp.engine.serving.settings import ENGINE_DEFAULTS

log = logging.getLogger(__name__)

HEADROOM_THREADS = 8
MIN_CONNECTIONS = 1024
# descriptors besides the connections: the listening sockets, model files, logs, the kernels' pipes
OTHER_FILES = 256


def waitress_adjustments(argv: list[str]):
    """Waitress's effective settings for the command line `argv`, or None when it is not waitress-serve's."""
    if not argv or not os.path.basename(argv[0]).startswith("waitress-serve"):
        return None
    from waitress.adjustments import Adjustments

    try:
        kw, _ = Adjustments.parse_args(argv[1:])
        for runner_only in ("help", "call"):
            kw.pop(runner_only, None)
        return Adjustments(**kw)
    except (getopt.GetoptError, ValueError, OSError):  # waitress reports its own bad arguments
        return None


def running_at_most(config) -> int:
    """Requests the engine runs at once: LLM_MAX_BATCH on a paged cache, LLM_SLOTS on slots; which
    one a model gets is known only once it loads, so the larger."""
    return max(int(config["SLOTS"]), int(config.get("MAX_BATCH") or ENGINE_DEFAULTS["MAX_BATCH"]))


def threads_needed(config) -> int:
    return running_at_most(config) + int(config["QUEUE_LIMIT"]) + HEADROOM_THREADS


def missing_flags(config, adjustments) -> list[str]:
    flags = []
    if adjustments.threads < threads_needed(config):
        flags.append(f"--threads={threads_needed(config)}")
    if adjustments.channel_request_lookahead < 1:
        flags.append("--channel-request-lookahead=1")
    if adjustments.connection_limit < MIN_CONNECTIONS:
        flags.append(f"--connection-limit={4 * MIN_CONNECTIONS}")
    if not adjustments.asyncore_use_poll:
        flags.append("--asyncore-use-poll")
    return flags


def allow_connections(argv: list[str]) -> int | None:
    """Raise this process's soft open-file limit (up to its hard one) to hold Waitress's connection
    limit; returns the limit now in force, or None when `argv` is not waitress-serve's."""
    import resource

    adjustments = waitress_adjustments(argv)
    if adjustments is None:
        return None
    wanted = adjustments.connection_limit + adjustments.threads + OTHER_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        soft = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft != resource.RLIM_INFINITY and soft < wanted:
        log.warning("open files are limited to %d, below the %d connections Waitress may hold (raise `ulimit -n`)", soft, wanted)
    return soft


def warn_if_underprovisioned(config, argv: list[str]) -> list[str]:
    """One loud warning when Waitress's settings cannot serve LLM_SLOTS + LLM_QUEUE_LIMIT requests
    well; returns the flags it asked for (empty when all is well or Waitress's settings are unknown)."""
    adjustments = waitress_adjustments(argv)
    if adjustments is None:
        return []
    flags = missing_flags(config, adjustments)
    if not flags:
        return []
    why = []
    if adjustments.threads < threads_needed(config):
        why.append(
            f"!! Waitress runs {adjustments.threads} threads, and every open stream holds one: "
            f"{running_at_most(config)} running (LLM_MAX_BATCH or LLM_SLOTS) + LLM_QUEUE_LIMIT={config['QUEUE_LIMIT']} + "
            f"{HEADROOM_THREADS} for /health and /metrics = {threads_needed(config)}.\n"
            "!! With fewer, /health, /metrics and new requests wait behind the streams."
        )
    if adjustments.channel_request_lookahead < 1:
        why.append(
            "!! --channel-request-lookahead is 0: a client that hangs up on a non-streamed request\n"
            "!! is never noticed, and its request keeps a slot until max_tokens."
        )
    if adjustments.connection_limit < MIN_CONNECTIONS or not adjustments.asyncore_use_poll:
        why.append(
            f"!! Waitress accepts at most {adjustments.connection_limit} connections"
            f"{'' if adjustments.asyncore_use_poll else ' and watches them with select()'}: that many idle\n"
            "!! sockets (slow or silent clients) and /health stops answering."
        )
    banner = "!" * 78
    log.warning("\n%s\n%s\n!! Add: %s\n%s", banner, "\n".join(why), " ".join(flags), banner)
    return flags

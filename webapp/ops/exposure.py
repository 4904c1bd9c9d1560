"""The start-up warning: `wsgi.py` logs loudly when the server listens beyond loopback without an
admin token (or an API key).

Contract: `listen_hosts(argv)` is where `waitress-serve` will listen; `warn_if_exposed(config,
hosts)` warns when that is more than this machine and the settings leave the pages or the API open.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable

from webapp.ops.waitress_settings import waitress_adjustments

log = logging.getLogger(__name__)


def listen_hosts(argv: list[str]) -> list[str] | None:
    """The addresses `waitress-serve` will listen on, or None when `argv` is not waitress's.

    Parsed with waitress's own option parser, so defaults match: without --listen or --host it
    listens on 0.0.0.0 (and ::). A --unix-socket counts as "unix", which is local.
    """
    adj = waitress_adjustments(argv)
    if adj is None:  # not waitress-serve, or arguments waitress will reject itself
        return None
    if adj.unix_socket:
        return ["unix"]
    return sorted({sockaddr[0] for _, _, _, sockaddr in adj.listen})


def is_loopback(host: str) -> bool:
    if host in ("localhost", "unix"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve to anything


def warn_if_exposed(config, hosts: Iterable[str] | None) -> bool:
    """Log loudly when the server may be reachable beyond this machine without an admin token.

    `hosts` None means the listen address is unknown (not started by `waitress-serve`); then the
    `HOST` setting (`LLM_HOST`) decides, and without it the server is assumed to be exposed.
    Returns True when it warned about the admin token.
    """
    if hosts is None:
        hosts = [config["HOST"]] if config.get("HOST") else None
    exposed = hosts is None or not all(is_loopback(h) for h in hosts)
    if not exposed:
        return False
    where = ", ".join(hosts) if hosts else "an unknown address"
    if not config.get("API_KEY"):
        log.warning("listening on %s without LLM_API_KEY: anyone who can reach it may use the API", where)
    if config.get("ADMIN_TOKEN"):
        return False
    banner = "!" * 78
    log.warning(
        "\n%s\n!! LLM_ADMIN_TOKEN is not set and the server listens on %s.\n"
        "!! /admin and /metrics are open to anyone who can reach this port.\n"
        "!! Set LLM_ADMIN_TOKEN, or listen on 127.0.0.1 only.\n%s",
        banner,
        where,
        banner,
    )
    return True

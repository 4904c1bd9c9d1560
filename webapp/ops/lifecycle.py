"""Admission, draining and graceful shutdown of the API's requests.

Contract:
- `Lifecycle.wrap(wsgi_app, drained)` is WSGI middleware that counts every request for which
  `drained(environ)` is true (the app passes its families' answer, `webapp.http.families`) from
  the moment it enters the app until the server closes its response (a stream included). A request
  counted there has been *accepted*: shutdown lets it finish or ends it with a clear error, never
  drops it. Once draining has begun, such a request is not counted but marked `environ[REFUSED]`
  and handed on, and the app answers it with a 503 and `Retry-After` in its family's error shape.
- `track(request)` / `forget(request)` keep the engine requests that handlers are reading, so
  that draining can cancel what is left when its time is up (with the reason "shutdown", which the
  API turns into a `server_shutting_down` error).
- `drain(seconds)` stops admitting, waits up to `seconds` for the accepted requests to finish,
  cancels the rest and waits a little for their handlers to answer. It returns a summary.
- `install_signal_handlers()` (main thread only; `wsgi.py` calls it) makes SIGTERM and SIGINT
  drain in a background thread while the server's main loop keeps flushing the responses, then
  stop the engine and raise `SystemExit(0)` in the main thread. Waitress's `serve()` catches
  that, closes its sockets and returns, so `waitress-serve` exits 0. A second signal cuts the wait
  short (cancel now); a third exits at once. Should the interpreter's own teardown then hang for
  more than `EXIT_GRACE_S` (it does when the signal went to the whole process group: tinygrad's
  compile-pool workers die with it, and Python's exit waits forever on a lock a dead worker held),
  the remaining child processes are killed and the process exits 0 anyway: by then every accepted
  request has been answered.

No Flask objects (it runs outside the app, as WSGI middleware), no tinygrad, and no knowledge of
URLs or error shapes: which requests are drained and how a refusal reads are the app's. Waiting is
on a `threading.Condition`, never a polling sleep.
"""

from __future__ import annotations

import _thread
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from werkzeug.wsgi import ClosingIterator

from webapp.engine.serving.request import FinishReason

log = logging.getLogger(__name__)

CANCEL_WAIT_S = 5.0  # how long cancelled requests get to send their last event
# After the last response has been handed to the server, its main loop still has to write it out;
# leaving the loop earlier would close sockets with the tail of a stream (`[DONE]`) unsent.
FLUSH_GRACE_S = 1.0
EXIT_GRACE_S = 5.0  # how long the interpreter's teardown may take once the drain is done
REFUSED = "webapp.lifecycle.refused"  # the environ key of a request that came while draining


class Lifecycle:
    def __init__(self, engine, drain_seconds: float = 30.0) -> None:
        self.engine = engine
        self.drain_seconds = float(drain_seconds)
        # Re-entrant: a signal handler on the main thread may notify while that thread holds it.
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0  # accepted drained requests whose response is not closed yet
        self._live: set = set()  # engine requests being read by a handler
        self._draining = False
        self._cancelling = False  # past the drain deadline: every live request gets cancelled
        self._hurry = threading.Event()  # a second signal: stop waiting, cancel now
        self._signals = 0
        self._exit_requested = False
        self.drain_thread: threading.Thread | None = None  # started by the first signal
        self._handlers_installed = False  # only then does a finished drain end the process

    # --- admission (WSGI middleware) -------------------------------------------------------------

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def wrap(self, wsgi_app, drained: Callable[[dict], bool]):
        def app(environ, start_response):
            if not drained(environ):
                return wsgi_app(environ, start_response)
            with self._lock:
                refused = self._draining
                if not refused:
                    self._in_flight += 1
            if refused:
                environ[REFUSED] = True  # the app answers it in its own shape, reading no body
                return wsgi_app(environ, start_response)
            try:
                # The response's close() (called by the server, a stream's included) ends the count.
                return ClosingIterator(wsgi_app(environ, start_response), self._leave)
            except BaseException:
                self._leave()
                raise

        return app

    def _leave(self) -> None:
        with self._lock:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.notify_all()

    # --- requests being read ------------------------------------------------------------------

    def track(self, request) -> None:
        with self._lock:
            self._live.add(request)
            late = self._cancelling
        if late:  # accepted before the drain began, submitted after its deadline
            self._cancel(request)

    def forget(self, request) -> None:
        with self._lock:
            self._live.discard(request)

    def _cancel(self, request) -> None:
        request.cancel(FinishReason.SHUTDOWN)  # the first reason sticks: abort's own "cancelled" is ignored
        self.engine.abort(request)

    # --- draining -----------------------------------------------------------------------------

    def drain(self, seconds: float | None = None) -> dict:
        """Stop admitting, let accepted requests finish for up to `seconds`, cancel the rest."""
        seconds = self.drain_seconds if seconds is None else seconds
        started = time.monotonic()
        with self._lock:
            self._draining = True
            waiting_for = self._in_flight
        log.warning(
            "draining: refusing new requests; %d in flight, waiting up to %g s",
            waiting_for,
            seconds,
        )
        finished = self._wait_idle(started + seconds, self._hurry)
        cancelled = 0
        if not finished:
            with self._lock:
                self._cancelling = True
                live = list(self._live)
            cancelled = len(live)
            log.warning("drain time is up: cancelling %d request(s)", cancelled)
            for request in live:
                self._cancel(request)
            finished = self._wait_idle(time.monotonic() + CANCEL_WAIT_S)
        summary = {
            "in_flight_at_start": waiting_for,
            "cancelled": cancelled,
            "unfinished": self._in_flight,
            "seconds": round(time.monotonic() - started, 3),
        }
        log.warning("drained: %s", summary)
        return summary

    def _wait_idle(self, deadline: float, interrupt: threading.Event | None = None) -> bool:
        with self._idle:
            while self._in_flight > 0:
                left = deadline - time.monotonic()
                if left <= 0 or (interrupt is not None and interrupt.is_set()):
                    return False
                # Woken by the last request leaving, or by a signal's notify_all below.
                self._idle.wait(left)
            return True

    # --- signals ------------------------------------------------------------------------------

    def install_signal_handlers(self) -> bool:
        """Drain on SIGTERM/SIGINT; only possible from the main thread. True when installed."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("not on the main thread: SIGTERM/SIGINT will not drain requests")
            return False
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        self._handlers_installed = True
        return True

    def _on_signal(self, signum, frame) -> None:
        # Runs on the main thread, between two bytecodes of the server's loop: it must not block.
        if self._exit_requested:
            raise SystemExit(0)
        self._signals += 1
        name = signal.Signals(signum).name
        if self._signals == 1:
            log.warning("%s: shutting down gracefully (LLM_DRAIN_SECONDS=%g)", name, self.drain_seconds)
            self.drain_thread = threading.Thread(target=self._drain_then_exit, name="drain", daemon=True)
            self.drain_thread.start()
        elif self._signals == 2:
            log.warning("%s again: cancelling the requests still running", name)
            self._hurry.set()
            with self._idle:
                self._idle.notify_all()
        else:
            log.warning("%s a third time: exiting now", name)
            raise SystemExit(0)

    def _drain_then_exit(self) -> None:
        try:
            self.drain()
            # A one-off pause, not a poll: the server's main loop writes out what the last
            # responses handed it (waitress offers no way to ask whether it has).
            time.sleep(FLUSH_GRACE_S)
            stop = getattr(self.engine, "stop", None)
            if stop is not None:
                stop(5)
        except Exception:
            log.exception("draining failed; exiting anyway")
        finally:
            self._exit_requested = True
        if not self._handlers_installed:
            return  # driven by hand (tests): draining is all that was asked for
        # Delivered as a signal to the main thread, whose handler above raises SystemExit.
        _thread.interrupt_main(signal.SIGTERM)
        # A daemon thread still runs while atexit handlers do; a normal exit ends it right here.
        time.sleep(EXIT_GRACE_S)
        _force_exit()


def _force_exit() -> None:
    sys.stderr.write(f"lifecycle: exit still unfinished {EXIT_GRACE_S:g} s after draining; killing child processes and exiting 0\n")
    sys.stderr.flush()
    for child in multiprocessing.active_children():
        child.kill()
    os._exit(0)

"""The WSGI entry point: `waitress-serve wsgi:app`. The one place the real engine is built and started.

`waitress-serve` imports this module on its main thread before it starts serving, which is what lets
us install the SIGTERM/SIGINT handlers here: they drain the accepted requests (up to
LLM_DRAIN_SECONDS), then make waitress's main loop exit, and `waitress-serve` returns 0. Waitress
installs no handlers of its own; without ours SIGTERM would kill the process mid-stream. The
command line also tells where the server listens, so an exposed server without an admin token is
reported loudly in the log, and how Waitress runs, so a pool too small for the slots and the queue,
a missing --channel-request-lookahead or a connection limit an idle crowd could fill is too, with the
flags to add; the open-file limit is raised to hold the connections.
"""

import logging
import os
import sys

# OpenBLAS's threads (NumPy's products: an image encoder's) spin for ~2^28 cycles after each product
# before they sleep, on the cores the kernels' own pool runs on the next moment: let them sleep at once
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

from webapp import create_app
from webapp.ops.exposure import listen_hosts, warn_if_exposed
from webapp.ops.waitress_settings import allow_connections, warn_if_underprovisioned

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
app = create_app()
app.extensions["lifecycle"].install_signal_handlers()
warn_if_exposed(app.config, listen_hosts(sys.argv))
warn_if_underprovisioned(app.config, sys.argv)
allow_connections(sys.argv)

"""The WSGI entry point: `waitress-serve wsgi:app`. The one place the real engine is built and started."""

import logging

from webapp import create_app

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
app = create_app()

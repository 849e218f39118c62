"""``python -m splitserve.decode_worker --model DIR``: one decode worker as a plain process."""

import sys

from splitserve.decode_worker.worker import DecodeWorker
from splitserve.worker_common.cli import main

sys.exit(main("decode", DecodeWorker))

"""``python -m splitserve.prefill_worker --model DIR``: one prefill worker as a plain process."""

import sys

from splitserve.prefill_worker.worker import PrefillWorker
from splitserve.worker_common.cli import main

sys.exit(main("prefill", PrefillWorker))

import sys

from splitserve.worker_common.cli import main

sys.exit(main("prefill"))

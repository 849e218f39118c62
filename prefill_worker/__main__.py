import sys

from worker_common.cli import main

sys.exit(main("prefill"))

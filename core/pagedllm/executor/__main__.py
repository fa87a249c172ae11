"""``python -m pagedllm.executor FD PARENT_PID DEATH_SIGNAL``: a multiprocessing-executor rank
(``rank_worker._main``); it exits with its parent (``parent_watch.py``) whatever way the parent ends."""

import os
import sys

from pagedllm.executor.parent_watch import exit_with_parent
from pagedllm.executor.rank_worker import _main

if __name__ == "__main__":
    exit_with_parent(int(sys.argv[2]), sys.argv[3] == "1")
    code = 1
    try:
        code = _main(int(sys.argv[1]))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

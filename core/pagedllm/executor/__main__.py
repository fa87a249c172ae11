"""``python -m pagedllm.executor FD``: a multiprocessing-executor rank (``rank_worker._main``)."""

import os
import sys

from pagedllm.executor.rank_worker import _main

if __name__ == "__main__":
    code = 1
    try:
        code = _main(int(sys.argv[1]))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

"""Entry point for `ray job submit --working-dir . -- python jobs/sweep.py --micro-batch 1,2,4,8 [--config ...] [--set ...]`.

Same arguments as `raytrain-fast sweep`. Results (table, CSV, JSON, best config) go to storage.uri.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the working dir's package

from raytrain_fast.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["sweep", *sys.argv[1:]]))

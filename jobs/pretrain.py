"""Entry point for `ray job submit --working-dir . -- python jobs/pretrain.py [--config ...] [--set ...] [--name ...]`.

Same arguments as `raytrain-fast pretrain`. Submitting again with the same --name resumes the run.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the working dir's package

from raytrain_fast.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["pretrain", *sys.argv[1:]]))

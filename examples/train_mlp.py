"""Train a small MLP for a few seconds on the GPU gpupool leased to it.

gpupool run --compute 30% --memory 8GiB -- python examples/train_mlp.py
"""

import sys

from gpupool.cli.demo_workload import main

if __name__ == "__main__":
    sys.exit(main())

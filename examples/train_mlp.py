"""Train a small MLP for a few seconds on whatever GPU gpupool leased: `gpupool run -c 30% -- python examples/train_mlp.py`."""

import sys

from gpupool.cli.demo_workload import main

if __name__ == "__main__":
    sys.exit(main())

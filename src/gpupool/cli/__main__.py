"""`python -m gpupool.cli`: the same as the `gpupool` command."""

from gpupool.cli.entry import run

run()

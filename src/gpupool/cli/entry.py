"""The `gpupool` command's entry point: the CLI's imports run without the cyclic collector."""

from __future__ import annotations

from gpupool.startup import imports_without_gc


def run() -> None:
    with imports_without_gc():
        from gpupool.cli.main import main
    main()

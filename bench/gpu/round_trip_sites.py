"""Where a remote program's round trips come from: the call sites of every request to the
worker during one GPT-2 `generate()` (transformers, from its config), counted by site.

    python bench/gpu/round_trip_sites.py --device cuda:0 [--layers 12 --tokens 16]

Starts a worker of its own on --device (seeing the GPUs this process was started with); the
client is this process, which then hides its GPUs from itself, as a client without one.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests" / "torch"), str(ROOT / "tests")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    import torch
    from real_programs import transformers_module

    import gpupool.torch
    from gpupool.protocol.v1.dataplane import start_worker_process
    from gpupool.torch import runtime, shapes

    transformers = transformers_module()
    folder = Path(tempfile.mkdtemp())
    proc, ready = start_worker_process(
        "sites", "sites", device=args.device, listen=f"unix:{folder}/w.sock",
        log_file=folder / "w.log", env=dict(os.environ),
    )  # fmt: skip
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything here asks CUDA
    try:
        gpupool.torch.attach(workers=[str(ready.address)], token="sites", lease="sites")
        config = transformers.GPT2Config(
            n_positions=1024, n_embd=args.width, n_layer=args.layers, n_head=4,
        )  # fmt: skip
        config._attn_implementation = "sdpa"
        model = transformers.GPT2LMHeadModel(config).cuda().eval()

        def generate(extra: int) -> None:
            ids = torch.randint(0, 1000, (1, 8 + extra)).cuda()
            with torch.no_grad():
                model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.tokens,
                    min_new_tokens=args.tokens, do_sample=False, pad_token_id=0,
                )  # fmt: skip

        generate(0)
        generate(1)
        stream = runtime.stream(0)
        sites: collections.Counter[str] = collections.Counter()
        original = stream._request_locked

        def counting(kind: object, *fields: object) -> object:
            frames = traceback.extract_stack()[:-1][-7:]
            where = (f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in frames[::-1])
            sites[" <- ".join(where)] += 1
            return original(kind, *fields)

        stream._request_locked = counting  # type: ignore[method-assign]
        trips, before = stream.round_trips, shapes.inference_counts()
        generate(2)
        after = shapes.inference_counts()
        print(f"{args.tokens} tokens: {stream.round_trips - trips} round trips; shape "
              f"inference {dict((k, after[k] - before[k]) for k in after)}")  # fmt: skip
        for site, count in sites.most_common(15):
            print(count, site)
    finally:
        proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())

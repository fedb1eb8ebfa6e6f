"""The worker's op fuzzer, run long: random aten overloads with adversarial arguments, as raw
data-plane frames from a hostile client, against a real CPU worker that holds planted secrets
(in its environment as GPUPOOL_TOKEN, and in its heap), next to another lease's worker.

    python bench/worker_fuzz.py [--minutes 10] [--ops N] [--seed S]
    python bench/worker_fuzz.py --replay SEED:SESSION      # one session again, its records shown

Checks after every op (tests/worker/worker_fuzzing.py): no reply holds a secret (raw, as text,
as int8/uint8/float views) or an address of the worker's memory; the worker is alive and
answers a SYNC; the other lease's worker keeps its tensor's values and answers. A worker that
crashes or hangs is restarted and the fuzz goes on; every finding names its seed and session.

Writes bench/results/worker_fuzz.json: ops tried, distinct overloads, outcomes, refusals and
errors by reason, findings (crashes, hangs, leaks) with the records that replay them, the
seeds, torch version and machine. The secrets themselves are never written, only digests.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.worker.worker_fuzzing import Finding, Fuzzer, Guard, machine, secret_digest  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "worker_fuzz.json"
REPLAY = "python bench/worker_fuzz.py --replay"
FINDINGS_KEPT_PER_OP = 3
"""Findings written per (kind, op): the first ones, with their records; the rest are counted.
A leak that follows an earlier one of its session (its op may only have passed the leaked
values on) counts apart, as a follow-on."""


def findings_json(findings: list[Finding]) -> dict[str, Any]:
    by_op: Counter[tuple[str, str]] = Counter()
    kept: list[dict[str, Any]] = []
    for finding in findings:
        key = (finding.kind + (" (follow-on)" if finding.follows else ""), finding.op)
        by_op[key] += 1
        if by_op[key] <= FINDINGS_KEPT_PER_OP:
            kept.append(
                {
                    "kind": finding.kind,
                    "op": finding.op,
                    "seed": finding.seed,
                    "session": finding.session,
                    "case": finding.case,
                    "detail": finding.detail,
                    "follows": finding.follows,
                    "replay": f"{REPLAY} {finding.seed}:{finding.session}",
                    "records": finding.records.splitlines()[-12:],
                    "log": finding.log.splitlines()[:16],
                }
            )
    return {
        "by_kind_and_op": {f"{kind} {op}": n for (kind, op), n in by_op.most_common()},
        "first": kept,
    }


def replay(spec: str, guard: Guard) -> int:
    seed_text, _, session_text = spec.partition(":")
    seed, session = int(seed_text), int(session_text or 0)
    with (
        tempfile.TemporaryDirectory(prefix="gp-fuzz-", dir="/tmp") as root,
        Fuzzer(seed, Path(root), guard, log=print) as fuzzer,
    ):
        fuzzer.run_session(session)
        for finding in fuzzer.tally.findings:
            print(f"\n{finding.line()}\n{finding.records}")
            if finding.log:
                print(f"worker log:\n{finding.log}")
        print(json.dumps(fuzzer.tally.summary(10), indent=1))
        return 1 if fuzzer.tally.findings else 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--ops", type=int, default=10**9, help="stop after this many op calls")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--ops-per-session", type=int, default=25)
    parser.add_argument("--reply-timeout-s", type=float, default=20.0)
    parser.add_argument("--replay", default=None, metavar="SEED:SESSION")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    guard = Guard(reply_timeout_s=args.reply_timeout_s)
    if args.replay:
        return replay(args.replay, guard)
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="gp-fuzz-", dir="/tmp") as root,
        Fuzzer(args.seed, Path(root), guard, args.ops_per_session, log=print) as fuzzer,
    ):
        setup_s = time.monotonic() - started
        fuzzing = time.monotonic()
        tally = fuzzer.run(args.ops, args.minutes * 60)
        fuzz_s = time.monotonic() - fuzzing
        secrets = fuzzer.secrets
    result: dict[str, Any] = {
        "seed": args.seed,
        "replay_sessions": f"{args.seed}:0 .. {args.seed}:{tally.sessions - 1}",
        "ops_per_session": args.ops_per_session,
        **tally.summary(),
        "ops_per_s": round(tally.ops_tried / fuzz_s, 1) if fuzz_s else None,
        "fuzz_s": round(fuzz_s, 1),
        "setup_s": round(setup_s, 1),
        "guard": vars(guard),
        "secret_digests": {
            "env GPUPOOL_TOKEN": secret_digest(secrets.env_token),
            "heap": secret_digest(secrets.heap),
            "other lease": secret_digest(secrets.other),
        },
        "findings": findings_json(tally.findings),
        "overloads_tried": sorted(tally.overloads),
        "machine": machine(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    shown = {
        k: v
        for k, v in result.items()
        if k not in ("findings", "overloads_tried", "errors_by_reason")
    }
    print(json.dumps(shown, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

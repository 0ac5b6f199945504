"""A stand-in trainer for the live tests: `python tests/helpers/live_writer.py OUT STEPS PERIOD [--extras]` writes
one step every PERIOD seconds with DriftLogger (tokens and routing shards, renamed into place) and prints the step
once its files are in place. With --extras it also drops, after step 1, a complete but corrupt Parquet file and, after
step 2, a JSON Lines file written in place slowly, in pieces that end mid-line (a reader that takes it before it
is complete gets a refusal or a partial load, both of which the test detects).

`step_arrays(step)` and `slow_rows()` give the test the exact values written, independently of the files."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

RUN = "live"
SLOW_RUN = "slow"
B, T, L, K, E = 2, 3, 2, 2, 4


def step_arrays(step: int) -> dict:
    rng = np.random.default_rng(1000 + step)
    s = -rng.exponential(1.0, (B, T))
    t = np.minimum(s + rng.normal(0, 0.05, (B, T)), 0.0)
    experts = np.argsort(rng.random((B, T, L, E)), axis=-1)[..., :K]
    return dict(sampler_logprobs=s, trainer_logprobs=t, mask=np.ones((B, T), dtype=np.int64),
                sampler_experts=experts, trainer_experts=experts[..., ::-1].copy())


def slow_rows(n: int = 8) -> list[dict]:
    return [{"run": SLOW_RUN, "step": 0, "sample": i // 4, "pos": i % 4, "sampler_logprob": -0.5 - i / 100,
             "trainer_logprob": -0.25 - i / 100} for i in range(n)]


def write_slowly(path: Path, pause: float = 0.4, piece: int = 150) -> None:
    """Pauses longer than the test's poll interval (0.25 s), shorter than its settle time (1.5 s): a watcher
    that read a file as soon as two polls saw it unchanged would read it half-written."""
    text = "".join(json.dumps(r) + "\n" for r in slow_rows())
    with open(path, "w") as fp:
        for lo in range(0, len(text), piece):
            fp.write(text[lo:lo + piece])
            fp.flush()
            time.sleep(pause)


def main(argv: list[str]) -> None:
    from analysis.record.logger import DriftLogger
    out, steps, period = Path(argv[0]), int(argv[1]), float(argv[2])
    extras = "--extras" in argv
    log = DriftLogger(out, run=RUN, config={"writer": "live_writer"})
    for step in range(steps):
        t0 = time.monotonic()
        log.log_step(step, **step_arrays(step))
        print(step, flush=True)
        if extras and step == 1:
            tmp = out / ".corrupt.parquet.tmp"
            tmp.write_bytes(b"PAR1" + bytes(range(200)))  # Parquet's magic, no footer
            tmp.replace(out / "corrupt.parquet")
        if extras and step == 2:
            write_slowly(out / "slow.jsonl")
        time.sleep(max(0.0, period - (time.monotonic() - t0)))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main(sys.argv[1:])

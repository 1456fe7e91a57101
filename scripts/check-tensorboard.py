#!/usr/bin/env python3
"""Read actguide's TensorBoard event files with TensorBoard's own reader.

    python3 -m venv /tmp/tb && /tmp/tb/bin/pip install tensorboard
    /tmp/tb/bin/python scripts/check-tensorboard.py          # writes a sample
    /tmp/tb/bin/python scripts/check-tensorboard.py RUN_DIR   # any event dir

Without an argument it has the `sample_for_tensorboard` unit test
(src/rundir/tensorboard.rs) write a sample into a temp dir and checks every
tag, step and value TensorBoard reads back. With a directory it only lists
what TensorBoard finds there. Not run by CI (needs the tensorboard package).
Exit 1 on any mismatch.
"""

import os
import subprocess
import sys
import tempfile

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def load(path):
    acc = EventAccumulator(path, size_guidance={"scalars": 0})
    acc.Reload()
    return acc


def dump(acc):
    tags = sorted(acc.Tags()["scalars"])
    print(f"scalar tags: {len(tags)}")
    for t in tags:
        pts = ", ".join(f"{e.step}:{e.value:g}" for e in acc.Scalars(t))
        print(f"  {t}: {pts}")
    return tags


def main():
    if len(sys.argv) > 1:
        dump(load(sys.argv[1]))
        return 0
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, ACTGUIDE_TB_SAMPLE_DIR=d)
        subprocess.run(
            ["cargo", "test", "-q", "--lib", "rundir::tensorboard::tests::sample_for_tensorboard"],
            cwd=root, env=env, check=True, stdout=subprocess.DEVNULL,
        )
        files = sorted(os.listdir(d))
        print(f"event files: {files}")
        acc = load(d)
        tags = dump(acc)
        want = {
            "train/step": [(0, 0.0), (1, 1.0), (2, 2.0)],
            "train/success": [(0, 0.0), (1, 0.25), (2, 0.5)],
            "train/kl": [(0, 0.0), (1, 0.0), (2, 0.0)],
            "train/time/step_s": [(0, 1.5), (1, 2.5), (2, 3.5)],
            "train/success_by_cluster/0": [(0, 0.5), (1, 0.5), (2, 0.5)],
            "train/success_by_cluster/1": [(0, 0.0), (1, 0.125), (2, 0.25)],
            "eval/success": [(2, 0.625)],
            "eval/success_in_region": [(2, 0.75)],
        }
        bad = []
        if sorted(want) != tags:
            bad.append(f"tags {tags} != {sorted(want)}")
        for tag, pts in want.items():
            got = [(e.step, e.value) for e in acc.Scalars(tag)] if tag in tags else []
            if got != pts:
                bad.append(f"{tag}: {got} != {pts}")
        wall = [e.wall_time for e in acc.Scalars("train/success")]
        if wall != [1_700_000_000.0, 1_700_000_001.0, 1_700_000_002.0]:
            bad.append(f"wall times {wall}")
        if bad:
            print("MISMATCH:\n  " + "\n  ".join(bad))
            return 1
        print("ok: TensorBoard reads every tag, step, value and wall time")
        return 0


if __name__ == "__main__":
    sys.exit(main())

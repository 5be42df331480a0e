"""Interleaved A/B of plan + BlockMask time between two builds of the Python package.

Each round runs one process per build (alternating), and each process times
``tessera.plan(mask, cache=False).to_flex_block_mask()`` for the cookbook families asked for: the
median of at least 20 calls and 0.5 s of calls after 3 warm-up calls. The report gives, per
family and build, every round's median and their median. Processes alternate so that a slow
spell of a shared guest hits both builds alike.

    # the base: pip install --no-deps --no-build-isolation --target /tmp/base-pkg ./bindings/python
    .venv/bin/python bench/block_mask_ab.py --a /tmp/base-pkg --b bindings/python/python \\
        --size 65536 --families "tree-causal,causal" --rounds 6
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child(size: int, families: str) -> None:
    sys.path.insert(0, HERE)
    import mask_cookbook as mc

    for name in families.split(","):
        r = mc.SIZES[name](size)
        for _ in range(3):
            mc.tessera_block_mask(r)
        ts, start = [], time.perf_counter()
        while len(ts) < 20 or time.perf_counter() - start < 0.5:
            t = time.perf_counter()
            mc.tessera_block_mask(r)
            ts.append(time.perf_counter() - t)
        print(f"{name}\t{statistics.median(ts) * 1e3:.4f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True, help="PYTHONPATH of build A (a directory holding tessera)")
    ap.add_argument("--b", required=True, help="PYTHONPATH of build B")
    ap.add_argument("--size", type=int, default=65536)
    ap.add_argument("--families", default="tree-causal,causal")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.size, args.families)
        return
    runs = {}
    for _ in range(args.rounds):
        for tag, path in (("A", args.a), ("B", args.b)):
            env = dict(os.environ, PYTHONPATH=os.path.abspath(path))
            cmd = [sys.executable, __file__, "--child", "--a", "-", "--b", "-"]
            cmd += ["--size", str(args.size), "--families", args.families]
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
            for line in out.splitlines():
                name, ms = line.split("\t")
                runs.setdefault((name, tag), []).append(float(ms))
    print(f"plan + BlockMask ms at {args.size} tokens, {args.rounds} rounds (A = {args.a}, B = {args.b})")
    for name in args.families.split(","):
        for tag in ("A", "B"):
            v = runs[(name, tag)]
            print(f"{name:40s} {tag}  median {statistics.median(v):8.3f}   rounds " + " ".join(f"{x:.3f}" for x in v))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Builds data/corpus/licenses.jsonl from Debian's /usr/share/common-licenses.

Not used by the build or the tests; kept so the corpus can be regenerated exactly:

    python3 data/corpus/make_corpus.py /usr/share/common-licenses data/corpus/licenses.jsonl

Each license text is split at blank lines into paragraphs, and consecutive paragraphs are grouped
into documents whose target sizes are drawn from a seeded generator: nine in ten documents are a
single paragraph (short), the rest are groups whose target size is log-uniform in 2-20 KB. Every
document is at least 100 bytes (short headings are merged into what follows) and at most 20 KB
(or one paragraph, if a single paragraph is longer). Symbolic links (GPL -> GPL-3, ...) are
skipped so no text appears twice. The output is deterministic.
"""

import json
import math
import os
import random
import sys

MIN_BYTES = 100
MAX_BYTES = 20_000


def paragraphs(text):
    out, cur = [], []
    for line in text.splitlines():
        if line.strip():
            cur.append(line)
        elif cur:
            out.append("\n".join(cur))
            cur = []
    if cur:
        out.append("\n".join(cur))
    return out


def target(rng):
    if rng.random() < 0.9:
        return 0  # a single paragraph (topped up to MIN_BYTES)
    lo, hi = math.log(2_000), math.log(MAX_BYTES)
    return int(math.exp(lo + (hi - lo) * rng.random()))


def documents(paras, rng):
    docs, cur, want = [], [], target(rng)
    for p in paras:
        size = len("\n\n".join(cur + [p]))
        if cur and size > MAX_BYTES:
            docs.append("\n\n".join(cur))
            cur, want = [], target(rng)
        cur.append(p)
        if len("\n\n".join(cur)) >= max(want, MIN_BYTES):
            docs.append("\n\n".join(cur))
            cur, want = [], target(rng)
    if cur:
        tail = "\n\n".join(cur)
        if docs and len(tail) < MIN_BYTES and len(docs[-1]) + len(tail) + 2 <= MAX_BYTES:
            docs[-1] = docs[-1] + "\n\n" + tail
        else:
            docs.append(tail)
    return docs


def main(src, dst):
    rng = random.Random(20240601)
    n = 0
    with open(dst, "w", encoding="utf-8", newline="\n") as out:
        for name in sorted(os.listdir(src)):
            path = os.path.join(src, name)
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            with open(path, encoding="utf-8") as f:
                text = f.read()
            for doc in documents(paragraphs(text), rng):
                out.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
                n += 1
    print(f"wrote {n} documents to {dst}", file=sys.stderr)


if __name__ == "__main__":
    main(*(sys.argv[1:3] if len(sys.argv) >= 3 else ("/usr/share/common-licenses", "licenses.jsonl")))

"""Every page's Python examples run in order, as pasted.

For README.md and each docs/*.md page, the ```python fenced blocks are extracted and run in
order in one fresh interpreter per page (this test's Python, in a temporary working directory,
with a fresh plan cache and a timeout), so a later block may use the names an earlier block of
the same page defined, exactly as a reader pasting them one after the other would. A failure
names the page, the block's index (0-based, counting every python block of the page) and its
line, and shows the error.

Skip convention: a block that cannot run on a CPU-only machine in one process (it needs a CUDA
GPU, a TPU, several processes, network access), or that is a signature or a sketch rather than
code, carries an HTML comment on the line right before its fence:

    <!-- skip: needs a CUDA GPU -->
    ```python
    ...

Markdown renderers hide the comment. Each skipped block is reported here as a skipped test with
its page, index and reason, so nothing is left out silently; a skipped block's names are not
defined for the blocks after it, which therefore must not depend on them.

The runs see two host JAX devices (``XLA_FLAGS=--xla_force_host_platform_device_count=2``, as
docs/jax.md's context-parallel example says to set on a CPU host); nothing else is prepared for
them: files a page reads are written by that page's own earlier blocks.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
TIMEOUT_S = 300

_FENCE_OPEN = re.compile(r"^```python\s*$")
_FENCE_CLOSE = re.compile(r"^```\s*$")
_SKIP = re.compile(r"^<!--\s*skip:\s*(.*?)\s*-->\s*$")


def pages():
    """README.md, then every docs/*.md page, as paths relative to the repository root."""
    docs = sorted(f for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
    return ["README.md"] + [f"docs/{f}" for f in docs]


def blocks(page):
    """The page's python blocks: dicts with ``index``, ``line`` (1-based line of the first code
    line), ``code`` and ``skip`` (the reason, or None)."""
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        lines = f.read().split("\n")
    out, i = [], 0
    while i < len(lines):
        if _FENCE_OPEN.match(lines[i]):
            prev = _SKIP.match(lines[i - 1]) if i > 0 else None
            j = i + 1
            while j < len(lines) and not _FENCE_CLOSE.match(lines[j]):
                j += 1
            assert j < len(lines), f"{page}:{i + 1}: python block never closed"
            out.append({"index": len(out), "line": i + 2, "code": "\n".join(lines[i + 1 : j]) + "\n",
                        "skip": prev.group(1) if prev else None})
            i = j
        i += 1
    return out


# The driver run in the fresh interpreter: executes the blocks in one namespace, in order, and on
# the first error prints the block's index and line with the traceback, exiting 1.
_DRIVER = r"""
import json, sys, traceback
page, path, blocks = json.load(open(sys.argv[1]))
ns = {"__name__": "__main__"}
for b in blocks:
    try:
        # padded, and named by the page's path, so that tracebacks show the page's own lines
        exec(compile("\n" * (b["line"] - 1) + b["code"], path, "exec"), ns)
    except BaseException:
        print(f"FAILED: {page}, python block {b['index']} (line {b['line']})", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
print("ok", len(blocks))
"""

_PAGES = [(p, blocks(p)) for p in pages()]
_RUN = [pytest.param(p, [b for b in bs if b["skip"] is None], id=p)
        for p, bs in _PAGES if any(b["skip"] is None for b in bs)]
_SKIPPED = [pytest.param(p, b, id=f"{p}#{b['index']}") for p, bs in _PAGES for b in bs if b["skip"]]


def test_skip_markers_are_well_formed():
    """A skip comment must sit right before a python fence (one that is anywhere else is a typo
    that would leave its block running, or mark nothing)."""
    bad = []
    for page in pages():
        with open(os.path.join(ROOT, page), encoding="utf-8") as f:
            lines = f.read().split("\n")
        for n, line in enumerate(lines):
            if _SKIP.match(line) and not (n + 1 < len(lines) and _FENCE_OPEN.match(lines[n + 1])):
                bad.append(f"{page}:{n + 1}")
            if "<!-- skip" in line and not _SKIP.match(line):
                bad.append(f"{page}:{n + 1} (malformed)")
    assert not bad, f"skip comments not right before a ```python fence: {bad}"


@pytest.mark.parametrize("page,runnable", _RUN)
def test_page_examples_run_in_order(page, runnable, tmp_path):
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps([page, os.path.join(ROOT, page), runnable]))
    driver = tmp_path / "driver.py"
    driver.write_text(_DRIVER)
    env = dict(os.environ)
    env["TESSERA_CACHE_DIR"] = tempfile.mkdtemp(prefix="cache-", dir=tmp_path)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    env.pop("PYTHONPATH", None)
    work = tmp_path / "cwd"
    work.mkdir()
    try:
        r = subprocess.run([sys.executable, str(driver), str(spec)], cwd=work, env=env,
                           capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"{page}: the examples ran past {TIMEOUT_S} s\n{err[-4000:]}", pytrace=False)
    if r.returncode != 0:
        pytest.fail(f"{page}: exit {r.returncode}\n{r.stderr[-6000:]}", pytrace=False)


@pytest.mark.parametrize("page,block", _SKIPPED)
def test_skipped_blocks(page, block):
    pytest.skip(f"{page}, python block {block['index']} (line {block['line']}): {block['skip']}")

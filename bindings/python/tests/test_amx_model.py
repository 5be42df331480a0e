"""The AMX kernels through the torch op against float64, on CPUs without AMX: a subprocess with
``TESSERA_AMX_MODEL=1`` (the software model of the tile unit) and ``TESSERA_CPU_PATHS=bf16=amx``
runs every case of ``test_torch_attention`` in bf16 storage (outputs, LSE and gradients, GQA,
Dqk ≠ Dv, softcap, sinks, masked rows, strided layouts; 128-query tiles and head dims that are
multiples of 32 put the products on tiles). The variables are read once per process, hence the
subprocess. Needs AVX512-BF16 (the rest of the kernel runs on it); skipped without it."""

import os
import subprocess
import sys

import pytest


HERE = os.path.dirname(os.path.abspath(__file__))

SCRIPT = r"""
import sys
sys.path.insert(0, HERE)
import torch
import tessera._tessera as t
print("amx:", t.amx, "| paths:", t.isa)
if not t.amx.startswith("used:") or "bf16 amx" not in t.isa:
    sys.exit(3)  # no AVX512-BF16 here: the AMX path cannot run
import test_torch_attention as tta
ran = 0
for p in tta._cases():
    m, b, hq, hkv, lq, lkv, dqk, dv, block, kw = p.values
    kw = dict(kw, dtype=torch.bfloat16)
    # the f32 cases' large-logit variants are past bf16 storage's tolerance by design
    if kw.get("q_scale", 1.0) > 1.0:
        continue
    tta.check_case(m, b, hq, hkv, lq, lkv, dqk, dv, block, **kw)
    tta.check_case(m, b, hq, hkv, lq, lkv, dqk, dv, 128, **kw)
    ran += 1
print("cases:", ran)
"""


def test_bf16_cases_match_float64_on_the_amx_path_of_the_model():
    env = dict(os.environ, TESSERA_AMX_MODEL="1", TESSERA_CPU_PATHS="bf16=amx")
    script = SCRIPT.replace("HERE)", repr(HERE) + ")", 1)
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                       timeout=600)
    if r.returncode == 3:
        pytest.skip("no AVX512-BF16 here (absent, or hidden by TESSERA_HIDE_ISA): "
                    + r.stdout.strip())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "amx: used: the software model" in r.stdout or "amx: used: AMX-BF16" in r.stdout
    cases = int(r.stdout.split("cases:")[1].split()[0])
    assert cases >= 15, r.stdout

"""The kernels compiled for other CPUs give the native run's tokens: every GGUF block format (the
tiny files of test_gguf_direct), run in a child process whose Numba target is an AVX2 laptop
(`haswell` with Haswell's features) or the x86-64-v2 baseline (no AVX, no FMA, no F16C).

Each target compiles into its own cache under .pytest_cache, so a second run (and CI, whose
kernel tiers for these targets fill the same directories first) reuses it. A cold compile for
two more targets costs minutes a format, so by default one format of each kernel family runs;
`--every-format` (CI's kernel tier) runs them all."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from gguf_tiny import write_gguf
from hf_tiny import make_checkpoint
from test_gguf_direct import CASES, TOKENS

from minillm.core.model import Model
from minillm.warmup import HASWELL_FEATURES

pytestmark = pytest.mark.slow

TARGETS = {"haswell": HASWELL_FEATURES, "x86-64-v2": None}
# integer products on regrouped rows (a 32-value block, a 256-value super-block), float sums over
# dequantized blocks, and the bfloat16 kernels
ONE_OF_EACH_FAMILY = ("q4_0", "q4_k", "q4_1", "bf16")
GENERATED = 8

CHILD = """
import json, sys
sys.path[:0] = ["tests", "."]
import numpy as np
from minillm.core.model import Model
from minillm.kernels import target
from test_targets import greedy
paths, tokens, generated, out = json.loads(sys.argv[1])
results = {"target": target.describe(), "runs": {}}
for name, path in paths.items():
    model = Model.load(path)
    np.save(f"{out}/{name}.npy", model.forward(tokens, model.new_cache(), all_logits=True))
    results["runs"][name] = greedy(model, tokens, generated)
print(json.dumps(results))
"""


def target_env(cpu, request):
    """The environment of a child compiling for `cpu`, in that target's own cache."""
    env = dict(os.environ, NUMBA_CPU_NAME=cpu, NUMBA_CACHE_DIR=str(request.config.cache.mkdir(f"numba-{cpu}")))
    if TARGETS[cpu] is not None:
        env["NUMBA_CPU_FEATURES"] = TARGETS[cpu]
    else:
        env.pop("NUMBA_CPU_FEATURES", None)
    return env


def greedy(model, tokens, generated):
    cache, text = model.new_cache(), []
    step = model.forward(tokens[:8], cache)
    for _ in range(generated):
        text.append(int(step.argmax()))
        step = model.forward([text[-1]], cache)
    return text


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory, request):
    paths = {}
    names = list(CASES) if request.config.getoption("--every-format") else ONE_OF_EACH_FAMILY
    for name in names:
        arch, shape, qtype = CASES[name]
        root = tmp_path_factory.mktemp(name)
        make_checkpoint(root / "hf", arch=arch, **shape)
        paths[name] = str(write_gguf(root / "hf", root / "model.gguf", qtype=qtype))
    return paths


@pytest.mark.parametrize("cpu", list(TARGETS))
def test_other_targets_give_the_native_tokens(cpu, gguf_files, tmp_path, request):
    env = target_env(cpu, request)
    tokens = [int(t) for t in TOKENS]
    argument = json.dumps([gguf_files, tokens, GENERATED, str(tmp_path)])
    child = subprocess.run([sys.executable, "-c", CHILD, argument], env=env, capture_output=True, text=True,
                           cwd=request.config.rootpath)
    assert child.returncode == 0, child.stderr[-3000:]
    theirs = json.loads(child.stdout.strip().splitlines()[-1])
    assert cpu in theirs["target"] and "AVX-512" not in theirs["target"]
    for name, path in gguf_files.items():
        model = Model.load(path)
        assert theirs["runs"][name] == greedy(model, tokens, GENERATED), name
        ours = model.forward(tokens, model.new_cache(), all_logits=True)
        # the same sums in the same order; only FMA against a separate multiply and add (x86-64-v2
        # has no FMA) may move a last bit
        np.testing.assert_allclose(np.load(tmp_path / f"{name}.npy"), ours, rtol=1e-5, atol=1e-5 * np.abs(ours).max())


INT8_CHILD = """
import sys
sys.path[:0] = ["tests", "."]
import numpy as np
from test_targets import int8_products
np.save(sys.argv[1], int8_products())
"""


def int8_products():
    """int8 weights against 21 tokens at once (register tiles and the rows left over) and one at
    a time (decode's dot products): (2, 21, 40) float32."""
    from test_kernels import low_precision

    from minillm import kernels as K

    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((21, 613)).astype(np.float32), rng.standard_normal((40, 613)).astype(np.float32)
    q, fmt, s, _, _ = low_precision(w, "int8")
    together, alone = np.empty((21, 40), np.float32), np.empty((21, 40), np.float32)
    K.matmul(together, x, q, fmt, s)
    for t in range(21):
        K.matmul(alone[t : t + 1], x[t : t + 1], q, fmt, s)
    return np.stack([together, alone])


@pytest.mark.parametrize("cpu", list(TARGETS))
def test_int8_products_agree_on_every_target(cpu, tmp_path, request):
    """int8 sums are 16 lanes with AVX-512 and 8 lanes elsewhere (kernels.vector_ir), so other
    targets' int8 products move from the native ones in the last bits only; on each target the
    tiles and the lone dot products still agree to the bit."""
    env = target_env(cpu, request)
    child = subprocess.run([sys.executable, "-c", INT8_CHILD, str(tmp_path / "theirs.npy")], env=env, capture_output=True, text=True,
                           cwd=request.config.rootpath)
    assert child.returncode == 0, child.stderr[-3000:]
    ours, theirs = int8_products(), np.load(tmp_path / "theirs.npy")
    np.testing.assert_array_equal(ours[0], ours[1])
    np.testing.assert_array_equal(theirs[0], theirs[1])
    np.testing.assert_allclose(theirs, ours, rtol=1e-5, atol=1e-5 * np.abs(ours).max())

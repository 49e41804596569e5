"""Numba CPU kernels for a pre-norm Llama forward pass, and the weight formats they run.

Every kernel is a pure function over preallocated arrays, output first, and has a plain NumPy
reference in tests/test_kernels.py. Shapes: T rows (tokens), H hidden, K/N matmul in/out,
nh/nkv query/KV heads, hd head dim, ctx cache length.

    formats     the table of weight formats
    forward     the layer sequence over a batch of rows: prefill, decode, batched decode
    forward_types, steps, step_calls, experts  what it reads, its steps, running them, a MoE layer
    row_spans   a step's work on a span of rows; attention's tasks
    lora        a LoRA adapter's update beside a base product
    matmul      linear layers for every format, tiles chosen by row count; each format's kernels
    attention   causal GQA attention over the KV cache
    rmsnorm, rope, swiglu                      the other operations of a layer
    row_products, gguf_blocks, integer_products the dot products of each family of formats
    grouped_layouts                            block formats regrouped by 16 rows, for integer_products
    activation_operands, quantize              activations and weights converted for them
    float_sums, vector_ir, vector_math         fixed-order sums and their LLVM building blocks
    top_k, logit_mask                          sampling's kernels
    work_sharing, jit, target                  threads, Numba settings, the CPU compiled for
"""

# This folder is `minillm.kernels` (minillm/__init__.py, pyproject.toml). From a checkout, the repository
# root is on sys.path (python cli.py, python -m pytest), so `import kernels` finds this folder under its
# bare name too, ahead of Hugging Face's package of that name, which transformers imports (from 5.25 on,
# names and all). Imported so, this folder hands the name over to that package where it is installed, and
# else stays empty (no version: not that package), rather than load every kernel a second time.
if __name__ == "minillm.kernels":
    from .exports import *  # noqa: F401,F403
    from .exports import __all__  # noqa: F401
else:
    def _hand_over_the_bare_name():
        """Load the installed `kernels` (the first on sys.path outside this checkout) as sys.modules["kernels"]:
        the import statement returns what is there once this module has run."""
        import importlib.machinery
        import importlib.util
        import os
        import sys

        checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != checkout]
        spec = importlib.machinery.PathFinder.find_spec("kernels", elsewhere)
        if spec is None or spec.loader is None:
            return
        module = importlib.util.module_from_spec(spec)
        sys.modules["kernels"] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules["kernels"]
            raise

    _hand_over_the_bare_name()

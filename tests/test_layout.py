"""The code's shape: no import cycles, no module reaching into another's private names, short
functions outside the kernels, and an install that adds nothing to site-packages but minillm."""

import ast
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from site import getsitepackages

import pytest

ROOT = Path(__file__).resolve().parent.parent


def package_modules() -> dict[str, Path]:
    """minillm's modules by dotted name, the checkout's kernels/ as minillm.kernels."""
    out = {}
    for path in [*(ROOT / "minillm").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")]:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[0] == "kernels":
            parts.insert(0, "minillm")
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imported(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The module an `from x import y` names, relative imports resolved."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


MODULES = package_modules()
TREES = {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in MODULES.items()}


def test_no_import_cycles():
    """Imports between minillm's modules form no cycle, those inside functions included (a lazy
    import is no cycle at import time, but it is one in the design: kernels.formats, the table,
    is a leaf that the kernels read)."""
    edges = {}
    for name, tree in TREES.items():
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = imported(name, MODULES[name], node)
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
        edges[name] = {t for t in targets if t in MODULES and t != name}
    done, path = set(), []

    def visit(node):
        if node in path:
            pytest.fail("import cycle: " + " -> ".join(path[path.index(node):] + [node]))
        if node in done:
            return
        path.append(node)
        for nxt in sorted(edges[node]):
            visit(nxt)
        path.pop()
        done.add(node)

    for name in sorted(edges):
        visit(name)


def test_no_module_imports_another_modules_private_names():
    found = []
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and imported(name, MODULES[name], node) != name:
                found += [(name, a.name) for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert not found


def test_functions_outside_the_kernels_are_short():
    """Around 80 lines at most: a longer function is two ideas (kernels, whose IR builders unroll
    loops by design, are exempt)."""
    long = []
    for name, tree in TREES.items():
        if name.startswith("minillm.kernels"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long.append((name, node.name, node.end_lineno - node.lineno + 1))
    assert not long


def running_environment_paths() -> list[str]:
    """The site-packages folders of the interpreter running the tests (a venv's own when in one)."""
    paths = [*getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    return list(dict.fromkeys(p for p in paths if os.path.isdir(p)))


@pytest.mark.slow
def test_kernel_modules_stay_small():
    """One concept per kernel module: none grows past about 500 lines (split it by job instead)."""
    long = {path.name: n for path in sorted((ROOT / "kernels").glob("*.py")) if (n := len(path.read_text().splitlines())) > 520}
    assert not long, long


def test_an_install_adds_only_minillm_beside_pypis_kernels(tmp_path):
    """`pip install .` (not editable) beside Hugging Face's `kernels` from PyPI: only minillm, its
    dist-info and its console script land; `import kernels` stays theirs; `minillm generate` runs.
    The new venv sees the packages of the environment running the tests (numpy, numba, .. the
    default model's wheel, and what PyPI's `kernels` imports), named in a .pth file: its
    --system-site-packages would see the base interpreter's instead, which inside a virtual
    environment is not where `pip install ".[test]"` put them."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True,
                               text=True, check=True).stdout.strip())
    (site / "outer_environment.pth").write_text("\n".join(running_environment_paths()) + "\n")
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    # --ignore-installed: the outer environment may hold it too (transformers 5.25 depends on it)
    subprocess.run(pip + ["--no-deps", "--ignore-installed", "kernels"], check=True, capture_output=True)
    before = set(os.listdir(site))
    bin_before = set(os.listdir(venv / "bin"))
    subprocess.run(pip + ["--no-deps", str(ROOT)], check=True, capture_output=True, cwd=tmp_path)
    added = set(os.listdir(site)) - before
    assert len(added) == 2 and "minillm" in added and any(n.startswith("minillm-") and n.endswith(".dist-info") for n in added), added
    assert set(os.listdir(venv / "bin")) - bin_before == {"minillm"}
    assert (site / "minillm" / "kernels" / "forward.py").is_file() and not (site / "kernels" / "forward.py").exists()
    theirs = subprocess.run([python, "-c", "import kernels, importlib.metadata as m; print(kernels.__file__, m.version('kernels'))"],
                            capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    assert str(site / "kernels") in theirs
    env = dict(os.environ, MINILLM_WEIGHTS=str(ROOT / "weights"), NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    out = subprocess.run([venv / "bin" / "minillm", "generate", "--prompt", "The capital of France is", "--max-tokens", "4",
                          "--temperature", "0"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    assert out.returncode == 0 and out.stdout.strip(), out.stderr[-2000:]


def test_a_checkout_root_on_sys_path_leaves_pypis_kernels_theirs():
    """From a checkout (`python cli.py`, `python -m pytest`: the root on sys.path) `import kernels`
    finds this checkout's kernels/ folder first; it hands the name to Hugging Face's package where
    installed (transformers 5.25 imports names from it) and else stays empty, never our kernels."""
    import importlib.machinery

    code = "import kernels; print(getattr(kernels, '__file__', None)); print(hasattr(kernels, 'forward'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout.split()
    path, has_forward = out[0], out[1]
    assert has_forward == "False"
    sys_path_without_root = [p for p in sys.path if Path(p or ".").resolve() != ROOT]
    installed = importlib.machinery.PathFinder.find_spec("kernels", sys_path_without_root)
    if installed is not None:
        assert path == installed.origin, (path, installed.origin)
        subprocess.run([sys.executable, "-c", "import transformers, kernels, importlib.metadata as m; m.version('kernels')"],
                       check=True, cwd=ROOT)
    else:
        assert Path(path).resolve() == ROOT / "kernels" / "__init__.py"


def test_the_kernels_are_imported_as_minillm_kernels():
    """Nothing imports the kernels by the folder's bare name: from a checkout that name belongs to
    Hugging Face's package (the test above), so `from kernels.x import y` fails there."""
    bare = []
    for path in [ROOT / "cli.py", *sorted(ROOT.glob("minillm/**/*.py")), *sorted(ROOT.glob("tests/*.py")),
                 *sorted(ROOT.glob("benchmarks/*.py"))]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            bare += [f"{path.relative_to(ROOT)}:{node.lineno}" for n in names if n == "kernels" or n.startswith("kernels.")]
    assert not bare, bare


def test_a_checkout_keeps_its_models_in_its_weights_folder(monkeypatch):
    from minillm.loading.default_model import weights_dir

    monkeypatch.delenv("MINILLM_WEIGHTS", raising=False)
    assert weights_dir() == ROOT / "weights"


def test_the_docs_format_table_is_the_format_table():
    from minillm.kernels import formats

    assert formats.markdown_table() in (ROOT / "docs" / "performance.md").read_text(encoding="utf-8"), \
        "docs/performance.md: paste kernels.formats.markdown_table() again"


def test_docs_model_table_is_the_specs():
    """docs/models.md's architecture table is written from the specs (architectures.model_table)."""
    from minillm.architectures import model_table

    assert model_table() in (ROOT / "docs" / "models.md").read_text(encoding="utf-8")


def test_architecture_names_are_tested_only_in_the_specs():
    """No loader or kernel asks which architecture it holds: that is the specs' business."""
    import re

    pattern = re.compile(r"arch(itecture)? ?(==|!=|in) ")
    found = [f"{path}:{n}" for name, path in MODULES.items() if not name.startswith("minillm.architectures")
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert not found

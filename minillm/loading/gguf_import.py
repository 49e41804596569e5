"""Importing a GGUF file as an ordinary HF checkpoint directory.

gguf_file.GGUFModel reads the file as an HF model (config fields, tensors by HF name with what
llama.cpp's converter changed undone, the tokenizer rebuilt from its vocabulary); here its
tensors are dequantized to float32 and written as model.safetensors beside config.json and the
tokenizer files. transformers reads the same GGUF (`from_pretrained(dir, gguf_file=...)`), so it
checks every file written here.

Everything is written into a temporary directory beside the destination and renamed at the end,
so an interrupted import never leaves a half-made model under the final name.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from ..errors import GGUFError
from .gguf_file import GGUFModel, write_text_files
from .safetensors_io import write_safetensors

TMP_PREFIX = ".importing-"


def import_gguf(gguf_path: str | Path, dest: str | Path, progress: bool = True) -> Path:
    """Import `gguf_path` into the HF-format directory `dest` (which must not exist yet)."""
    gguf_path, dest = Path(gguf_path), Path(dest)
    if dest.exists():
        raise GGUFError(f"{dest}: already exists")
    model = GGUFModel(gguf_path)  # everything below reads what its check parsed and validated
    files = model.text_files()

    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_imports(dest.parent)
    tmp = dest.parent / f"{TMP_PREFIX}{dest.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        bar = _progress(len(model.entries), f"importing {gguf_path.name}" if progress else None)
        tensors = {}
        for name in model.entries:
            tensors[name] = model.float32(name)
            bar.update(1)
        bar.close()
        write_safetensors(tmp / "model.safetensors", tensors, metadata={"format": "pt"})
        del tensors
        write_text_files(tmp, files)
        # Where the weights came from: `compare` uses transformers reading this same GGUF as the oracle.
        record = {"source": gguf_path.name, "path": str(gguf_path.resolve()), "size": gguf_path.stat().st_size}
        _write_json(tmp / "minillm_import.json", record)
        os.rename(tmp, dest)  # atomic: the model appears whole or not at all
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if (dest / "config.json").exists():  # another process finished the same import first
            return dest
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _progress(total: int, desc: str | None):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", disable=desc is None, file=sys.stderr, leave=False)


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _remove_stale_imports(parent: Path) -> None:
    """Delete temporary directories left by imports that were killed (their process is gone)."""
    for tmp in parent.glob(TMP_PREFIX + "*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

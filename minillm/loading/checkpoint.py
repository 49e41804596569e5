"""Loading an HF checkpoint directory or a GGUF file into weight matrices, each in a named format
of kernels.formats (float32, bfloat16 bits, int8 blocks, Q4_0 blocks, or a GGUF's block formats
as stored), with HF names and (out, in) layouts.

This is the one boundary for weight names: every expected tensor is checked for presence and
shape here, before any kernel can see it (a Numba kernel does not check bounds).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from ..errors import CheckpointError
from ..kernels import formats as F
from ..memory import CACHE_LINE, aligned_empty, release_pages
from .config import ModelConfig
from .safetensors_io import SafetensorsFile
from .tensor_names import (
    HARMLESS_SUFFIXES, STACKED_DOWN, STACKED_GATE_UP, check_tensor_set, expected_shapes, expert_matrix, latent_rows, moe_prefix,
    rope_halves_order, router_name,
)

DTYPES = tuple(F.LOAD_DTYPES)  # what weights can be converted to at load (kernels.formats)
GGUF_STORED = F.AS_STORED  # a GGUF file's tensors as stored
CONVERT_CHUNK = 1 << 22  # elements converted at a time, so conversion needs no full float32 copy


@dataclass
class Linear:
    """A weight matrix of N rows in one format (kernels.formats), with its optional bias."""

    w: np.ndarray  # the rows as the format stores them: float32 | uint16 (bfloat16 bits) | int8 | uint8 (blocks)
    format: F.WeightFormat
    scales: np.ndarray | None = None  # I8: (N, ceil(K / 32)) float16 scales as uint16 bits
    b: np.ndarray | None = None  # (N,) float32

    @property
    def rows(self) -> int:
        return self.w.shape[0]

    @property
    def nbytes(self) -> int:
        return self.w.nbytes + (self.scales.nbytes if self.scales is not None else 0)


@dataclass
class LayerWeights:
    """One layer's weights. A norm is None where the architecture has none at that place
    (the spec's norm_names); norms that scale by (1 + w) are stored as 1 + w."""

    attn_norm: np.ndarray | None  # (H,) before attention
    q: Linear  # (q_dim, H)
    k: Linear  # (kv_dim, H)
    v: Linear  # (kv_dim, H)
    o: Linear  # (H, q_dim)
    attn_out_norm: np.ndarray | None  # (H,) on attention's output, before the residual add
    mlp_norm: np.ndarray | None  # (H,) before the MLP
    gate: Linear | None  # (I, H); in a sparse layer the shared expert's, or None
    up: Linear | None  # (I, H)
    down: Linear | None  # (H, I)
    mlp_out_norm: np.ndarray | None  # (H,) on the MLP's output
    q_norm: np.ndarray | None = None  # (head_dim,) or (q_dim,): cfg.qk_norm
    k_norm: np.ndarray | None = None  # (head_dim,) or (kv_dim,)
    router: Linear | None = None  # a sparse layer's (E, H) router, float32; (E + 1, H) with the shared expert's gate last
    experts: list[tuple[Linear, Linear, Linear]] = field(default_factory=list)  # each expert's (gate, up, down)
    selection_bias: np.ndarray | None = None  # (E,) float32: added to the router's scores for choosing only
    activation_params: np.ndarray | None = None  # (4,) float32: xIELU's alpha_p, alpha_n, beta, eps (Architecture.layer_activation)
    sinks: np.ndarray | None = None  # (nh,) each head's attention sink logit (gpt-oss)
    # latent attention (cfg.latent): q, k, v above read the latents (latent_rows), these make them
    q_a: Linear | None = None  # (q_lora_rank, H), or None: q reads the input
    kv_a: Linear | None = None  # (kv_lora_rank + rope_dim, H): the kv latent, then the shared RoPE key (latent_rows)
    q_a_norm: np.ndarray | None = None  # (q_lora_rank,)
    kv_a_norm: np.ndarray | None = None  # (kv_lora_rank,)

    @property
    def linears(self) -> list[Linear]:
        """Every weight matrix of the layer."""
        mlp = [m for m in (self.gate, self.up, self.down, self.router, self.q_a, self.kv_a) if m is not None]
        return [self.q, self.k, self.v, self.o, *mlp, *(m for expert in self.experts for m in expert)]


@dataclass
class Weights:
    dtype: str
    embed: Linear  # (V, H)
    layers: list[LayerWeights]
    norm: np.ndarray  # (H,)
    lm_head: Linear  # (V, H); the embedding itself when tied

    @property
    def nbytes(self) -> int:
        """Bytes of weights at the compute precision (tied tensors counted once)."""
        seen, total = set(), 0
        for arr in self._arrays():
            if id(arr) not in seen:
                seen.add(id(arr))
                total += arr.nbytes
        return total

    @property
    def formats(self) -> frozenset:
        """The formats the weight matrices come in."""
        return frozenset(lin.format for lin in self._linears())

    def _linears(self):
        return (self.embed, self.lm_head, *(m for L in self.layers for m in L.linears))

    def _arrays(self):
        for lin in (self.embed, self.lm_head):
            yield lin.w
            if lin.scales is not None:
                yield lin.scales
        yield self.norm
        for L in self.layers:
            yield from (n for n in (L.attn_norm, L.attn_out_norm, L.mlp_norm, L.mlp_out_norm, L.q_norm, L.k_norm, L.sinks, L.q_a_norm, L.kv_a_norm)
                        if n is not None)
            for lin in L.linears:
                yield lin.w
                if lin.scales is not None:
                    yield lin.scales
                if lin.b is not None:
                    yield lin.b


def open_shards(model_dir: Path) -> dict[str, SafetensorsFile]:
    """{tensor name: the file holding it}, from model.safetensors or a sharded index."""
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a valid index: {e}") from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: field 'weight_map' must be an object")
        files: dict[str, SafetensorsFile] = {}
        owner: dict[str, SafetensorsFile] = {}
        for name, shard in weight_map.items():
            if shard not in files:
                files[shard] = SafetensorsFile(_shard_path(model_dir, index, shard))
            if name not in files[shard].tensors:
                raise CheckpointError(f"{index}: tensor {name!r} is mapped to {shard}, which does not hold it")
            owner[name] = files[shard]
        for shard, f in files.items():
            for name in f.tensors:
                if owner.get(name) is not f:
                    raise CheckpointError(f"{f.path}: tensor {name!r} is not mapped to this shard by {index.name}")
        return owner
    if single.exists():
        f = SafetensorsFile(single)
        return {name: f for name in f.tensors}
    raise CheckpointError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def _shard_path(model_dir: Path, index: Path, shard) -> Path:
    """A shard named by the index: a plain file name inside the model directory, never a way out."""
    if (
        not isinstance(shard, str)
        or not shard
        or shard in (".", "..")
        or "/" in shard
        or "\\" in shard
        or "\0" in shard
        or os.path.isabs(shard)
    ):
        raise CheckpointError(f"{index}: shard name {shard!r} is not a plain file name")
    path = model_dir / shard
    target, home = path.resolve(), model_dir.resolve()
    # a Hugging Face cache snapshot (minillm.loading.hub) links each file to its repository's blobs/
    in_hub_cache = home.parent.name == "snapshots" and target.parent == home.parent.parent / "blobs"
    if not (target.is_relative_to(home) or in_hub_cache):
        raise CheckpointError(f"{index}: shard {shard!r} leads outside the model directory")
    if not path.is_file():
        raise CheckpointError(f"{index}: shard {shard!r} does not exist")
    return path


def load_checkpoint(
    source: str | Path, dtype: str | None = None, check_finite: bool = False
) -> tuple[ModelConfig, Weights]:
    """Config and weights, checked against each other, from an HF checkpoint directory or a GGUF
    file. dtype: a precision of DTYPES the weights are converted to at load (default float32),
    or for a GGUF file by default "gguf": its tensors as stored (GGUF_STORED)."""
    source = Path(source)
    if dtype is not None and dtype not in DTYPES + (GGUF_STORED,):
        raise CheckpointError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES + (GGUF_STORED,))}")
    if source.is_file():
        return _load_gguf(source, dtype or GGUF_STORED, check_finite)
    if dtype == GGUF_STORED:
        raise CheckpointError(f"{source}: dtype {GGUF_STORED!r} is for GGUF files, not checkpoint directories")
    if not source.is_dir():
        raise CheckpointError(f"{source}: not a model directory or GGUF file")
    dtype = dtype or "float32"
    cfg, owner, shapes = checked_directory(source)

    def vector(name: str) -> np.ndarray:
        arr = np.array(owner[name].float32(name), dtype=np.float32)  # small: a private copy
        if check_finite:
            require_finite(arr, owner[name].path, name)
        return in_rope_order(cfg, name, arr)

    def matrix(name: str, rows: np.ndarray | None = None) -> Linear:
        """Tensor `name` as a Linear; `rows`: the stored rows it has, in this order (-1: a row of zeros)."""
        f = owner[name]
        order = rope_halves_order(cfg, name, f.tensors[name].shape[0]) if rows is None else rows
        if order is not None:  # reordered rows: a copy, converted as any other
            w = rows_in_order(f.float32(name), order)
            return pack(lambda r0, r1: w[r0:r1], w.shape, matrix_format(cfg, dtype, name), f.path, name, check_finite)
        stored = f.tensors[name].dtype
        if (stored, dtype) in (("F32", "float32"), ("BF16", "bfloat16")):  # the mapped file itself
            w = on_cache_lines(f.raw(name))  # a copy where the file's offsets are not (imports write them so)
            if check_finite:
                _check_finite(f, name, w if stored == "F32" else None)
            return Linear(w, F.BY_NAME[F.LOAD_DTYPES[dtype]])
        return pack(lambda r0, r1: f.read_rows(name, r0, r1), f.tensors[name].shape, matrix_format(cfg, dtype, name), f.path, name, check_finite)

    def stacked(name: str) -> list[Linear]:
        """A 3-D tensor (E, N, K) as E matrices: views of the mapped file, or each converted."""
        f = owner[name]
        stored, (E, N, Kdim) = f.tensors[name].dtype, f.tensors[name].shape
        if check_finite:
            require_finite(f.float32(name), f.path, name)
        if (stored, dtype) in (("F32", "float32"), ("BF16", "bfloat16")):
            return [Linear(on_cache_lines(f.raw(name)[e]), F.BY_NAME[F.LOAD_DTYPES[dtype]]) for e in range(E)]
        return [pack(lambda r0, r1, e=e: f.read_rows(name, e, e + 1)[0, r0:r1], (N, Kdim), dtype, f.path, f"{name}[{e}]") for e in range(E)]

    def transposed(name: str, parts: tuple[slice, ...]) -> list[list[Linear]]:
        """gpt-oss's experts `name`, stored transposed (E, K, N): per slice of `parts`, the E
        matrices of those of the N columns, converted. The tensor is read once for all parts."""
        f = owner[name]
        full = f.float32(name)
        if check_finite:
            require_finite(full, f.path, name)
        matrices = [[full[e][:, cols].T for e in range(full.shape[0])] for cols in parts]
        return [[pack(lambda r0, r1, t=t: t[r0:r1], t.shape, dtype, f.path, f"{name}[{e}]") for e, t in enumerate(ts)] for ts in matrices]

    def mxfp4(name: str, parts: tuple[slice, ...]) -> list[list[Linear]]:
        """gpt-oss's MXFP4 experts `name` (its _blocks and _scales, rows N not transposed): per slice
        of `parts`, the E matrices of those rows as GGUF's MXFP4 blocks, run as stored (regrouped
        for integer products) whatever the load precision."""
        blocks, scales = owner[name + "_blocks"].raw(name + "_blocks"), owner[name + "_scales"].raw(name + "_scales")
        return [[runnable_blocks(mxfp4_blocks(blocks[e, rows], scales[e, rows]), F.BY_NAME["MXFP4"]) for e in range(blocks.shape[0])]
                for rows in parts]

    return cfg, assemble(cfg, dtype, shapes, matrix, vector, stacked, transposed, mxfp4)


def checked_directory(source: Path) -> tuple[ModelConfig, dict, dict]:
    """An HF directory's config, the shard holding each tensor, and the tensors' expected shapes,
    checked against each other (a mixture of experts' layout found from the names)."""
    cfg = ModelConfig.from_file(source / "config.json")
    owner = renamed(open_shards(source), cfg.spec.checkpoint_renames)
    if not cfg.tie_word_embeddings and "lm_head.weight" not in owner:
        # A checkpoint that omits lm_head.weight ties it to the embeddings, whatever the flag says.
        cfg = replace(cfg, tie_word_embeddings=True)
    layout = "per_expert"
    if any(name.endswith(STACKED_GATE_UP) for name in owner):
        layout = "stacked"
    elif any(name.endswith(STACKED_GATE_UP + "_blocks") for name in owner):
        layout = "mxfp4"
    shapes = expected_shapes(cfg, layout)
    check_tensor_set(
        {name: f.tensors[name].shape for name, f in owner.items()}, shapes, cfg,
        where=lambda name: owner[name].path if name in owner else source,
        ignorable=lambda name: name.endswith(HARMLESS_SUFFIXES) or (name == "lm_head.weight" and cfg.tie_word_embeddings)
        or cfg.spec.ignores(name, cfg.num_hidden_layers),
    )
    return cfg, owner, shapes


def renamed(owner: dict[str, SafetensorsFile], renames) -> dict[str, SafetensorsFile]:
    """`owner` with tensor names respelled by the spec's checkpoint_renames ((pattern, replacement)),
    each file answering to the new name."""
    if not renames:
        return owner
    out = {}
    for name, f in owner.items():
        new = name
        for pattern, replacement in renames:
            new = re.sub(pattern, replacement, new)
        if new != name:
            f.tensors[new] = f.tensors.pop(name)
        out[new] = f
    return out


def rows_in_order(w: np.ndarray, order: np.ndarray) -> np.ndarray:
    """w's rows in `order` (a copy), a row of zeros where it says -1: of floats, or of GGUF blocks,
    whose zero bytes are zeros in every format (their scales are 0)."""
    out = w[np.maximum(order, 0)]
    out[order < 0] = 0
    return out


def in_rope_order(cfg: ModelConfig, name: str, w: np.ndarray) -> np.ndarray:
    """Tensor `name`'s rows as the RoPE kernel turns them (rope_halves_order; moved: a copy)."""
    if w.ndim == 0:  # a scalar (Apertus's xIELU beta and eps)
        return w
    order = rope_halves_order(cfg, name, w.shape[0])
    return w if order is None else w[order]


def mxfp4_blocks(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Checkpoint MXFP4 (N, K / 32, 16) + (N, K / 32), values 2j and 2j + 1 in byte j, as GGUF's
    MXFP4 rows (N, K / 32 * 17): each block its exponent byte (the same: ggml doubles the levels
    and halves the scale), then values j and j + 16 in byte j."""
    N, G, _ = blocks.shape
    out = aligned_empty((N, G * 17), np.uint8)
    rows = out.reshape(N, G, 17)
    step = max(1, CONVERT_CHUNK // max(G * 16, 1))
    for r0 in range(0, N, step):
        b = np.asarray(blocks[r0 : r0 + step])
        values = np.empty((*b.shape[:2], 32), np.uint8)
        values[..., 0::2], values[..., 1::2] = b & 15, b >> 4
        rows[r0 : r0 + step, :, 0] = scales[r0 : r0 + step]
        rows[r0 : r0 + step, :, 1:] = values[..., :16] | (values[..., 16:] << 4)
    return out


def _load_gguf(path: Path, dtype: str, check_finite: bool) -> tuple[ModelConfig, Weights]:
    """A GGUF file's weights: as stored (each matrix in its own format, kernels.formats; F32 and
    BF16 on the dense kernels, GGUF blocks read in place or regrouped), or converted to `dtype`."""
    from .gguf_file import GGUFModel

    model = GGUFModel(path)
    cfg, shapes = model.cfg, model.expected
    as_stored = dtype == GGUF_STORED
    if as_stored:  # named after what the file holds: one format ("float32" for an F32 file), or "gguf"
        stored = {F.BY_GGML_TYPE.get(model.ggml_type(name)) for name, shape in shapes.items() if len(shape) >= 2}
        dtype = {F.F32: "float32", F.BF16: "bfloat16"}.get(next(iter(stored)), GGUF_STORED) if len(stored) == 1 else GGUF_STORED

    def vector(name: str) -> np.ndarray:
        arr = model.float32(name)
        if check_finite:
            require_finite(arr, path, name)
        return in_rope_order(cfg, name, arr)

    def matrix(name: str, rows: np.ndarray | None = None) -> Linear:
        """Tensor `name` as a Linear; `rows`: its stored rows in this order (-1: a row of zeros)."""
        if name.endswith("k_b_proj.weight"):
            return _transposed_keys(model, name, rows, dtype if not as_stored else None, check_finite)
        if not as_stored:  # converted: dequantized whole (one tensor at a time), then packed
            w = model.float32(name)
            w = in_rope_order(cfg, name, w) if rows is None else rows_in_order(w.reshape(-1, w.shape[-1]), rows)
            return pack(lambda r0, r1: w[r0:r1], w.shape, matrix_format(cfg, dtype, name), path, name, check_finite)
        fmt = F.BY_GGML_TYPE.get(model.ggml_type(name))
        if fmt is None:
            raise CheckpointError(f"{path}: tensor {name!r} has ggml type {model.ggml_type(name)}, which minillm cannot run as stored; use --dtype float32")
        if shapes[name][-1] % fmt.block:
            raise CheckpointError(f"{path}: tensor {name!r} rows of {shapes[name][-1]} are not whole blocks of {fmt.block}; use --dtype float32")
        w = model.stored(name, as_bytes=fmt.is_gguf_blocks)
        w = in_rope_order(cfg, name, w) if rows is None else rows_in_order(w, rows)
        if check_finite:
            require_finite(model.float32(name), path, name)
        if not fmt.is_gguf_blocks:  # F32 or BF16: float32 or bfloat16 bits, on the dense kernels
            return Linear(on_cache_lines(w), fmt)
        if name == "model.embed_tokens.weight" and not cfg.tie_word_embeddings:
            # Only read a row per token: left in the file's blocks, mapped, so a page is in memory
            # once a token has used it, as llama.cpp keeps it (an 8B's is 280-560 MB)
            return Linear(np.asarray(w), fmt)
        return runnable_blocks(w, fmt, group=may_group(name))

    def stacked(name: str) -> list[Linear]:
        """A 3-D tensor of experts (E, N, K) as E matrices: row blocks of the stored rows, each
        run (or regrouped) as a 2-D matrix is; or dequantized and converted."""
        E, N, Kdim = shapes[name]
        if not as_stored:
            w = model.float32(name).reshape(E * N, Kdim)
            return [pack(lambda r0, r1, e=e: w[e * N + r0 : e * N + r1], (N, Kdim), dtype, path, f"{name}[{e}]", check_finite) for e in range(E)]
        fmt = F.BY_GGML_TYPE.get(model.ggml_type(name))
        if fmt is None:
            raise CheckpointError(f"{path}: tensor {name!r} has ggml type {model.ggml_type(name)}, which minillm cannot run as stored; use --dtype float32")
        if Kdim % fmt.block:
            raise CheckpointError(f"{path}: tensor {name!r} rows of {Kdim} are not whole blocks of {fmt.block}; use --dtype float32")
        if check_finite:
            require_finite(model.float32(name), path, name)
        rows = model.stored(name, as_bytes=fmt.is_gguf_blocks)
        if not fmt.is_gguf_blocks:
            return [Linear(on_cache_lines(rows[e * N : (e + 1) * N]), fmt) for e in range(E)]
        return [runnable_blocks(rows[e * N : (e + 1) * N], fmt, group=may_group(name)) for e in range(E)]

    def may_group(name: str) -> bool:
        """Whether a matrix may be regrouped (kernels.grouped_layouts): in a fused matrix, only
        with every part whole groups of 16 rows."""
        parts = {"self_attn.qkv_proj.weight": (cfg.q_dim, cfg.kv_dim), "mlp.gate_up_proj.weight": (cfg.intermediate_size,),
                 "mlp.experts.gate_up_proj.weight": (cfg.expert_intermediate_size,)}
        return all(n % F.GROUP_ROWS == 0 for n in parts.get(_matrix_kind(name), ()))

    return cfg, assemble(cfg, dtype, shapes, matrix, vector, stacked)


def _transposed_keys(model, name: str, rows: np.ndarray, dtype: str | None, check_finite: bool) -> Linear:
    """llama.cpp's k_b_proj (heads, kv_lora_rank, own part), each head's keys transposed: back to
    rows of kv_lora_rank in `rows`' order, converted to `dtype`; as stored (None), kept float32
    from a float file and Q8_0 from a block format (its blocks run along the rows it transposed)."""
    w = model.float32(name)
    w = rows_in_order(np.ascontiguousarray(w.transpose(0, 2, 1)).reshape(-1, w.shape[1]), rows)
    if dtype is None:
        stored = F.BY_GGML_TYPE.get(model.ggml_type(name))
        dtype = "q8_0" if w.shape[1] % F.BY_NAME["Q8_0"].block == 0 and (stored is None or stored.is_gguf_blocks) else "float32"
    return pack(lambda r0, r1: w[r0:r1], w.shape, dtype, model.path, name, check_finite)


def _matrix_kind(name: str) -> str:
    """A tensor's name without its layer: "model.layers.3.self_attn.v_proj.weight" -> "self_attn.v_proj.weight"."""
    if name.startswith("model.layers."):
        return name.split(".", 3)[3]
    return name


def assemble(cfg: ModelConfig, dtype: str, shapes: dict, matrix, vector, stacked=None, transposed=None, mxfp4=None) -> Weights:
    """Weights from a checked tensor source: matrix(name) -> Linear (without bias), vector(name) ->
    float32, stacked(name) -> a 3-D tensor's matrices (the experts of each, when shapes has them so);
    gpt-oss's checkpoints: transposed(name, parts) and mxfp4(name, parts) -> per slice of parts, the
    experts' matrices of those columns (stored transposed) or rows (MXFP4-packed)."""

    def norm(name: str | None) -> np.ndarray | None:
        if name is None or name + ".weight" not in shapes:
            return None
        w = vector(name + ".weight")
        if cfg.norm_offset:
            w = np.float32(1.0) + w  # x * (1 + w): the sum in float32, as transformers forms it
        return w

    def linear(prefix: str) -> Linear:
        lin = matrix(prefix + ".weight")
        lin.b = vector(prefix + ".bias") if prefix + ".bias" in shapes else None
        return lin

    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        latent = {}
        if cfg.latent:
            latent = _latent_attention(cfg, p + "self_attn.", shapes, matrix, norm)
            q, k, v = latent.pop("q"), latent.pop("k"), latent.pop("v")
        elif cfg.fused_qkv:  # Phi-3: row blocks of the fused matrix, views
            q, k, v = split_rows(linear(p + "self_attn.qkv_proj"), cfg.q_dim, cfg.kv_dim, cfg.kv_dim)
        else:
            q, k, v = (linear(p + f"self_attn.{n}_proj") for n in ("q", "k", "v"))
        mlp: dict = {}
        if cfg.layer_is_sparse(i):
            mlp = _experts(cfg, i, shapes, linear, vector, stacked, transposed, mxfp4)
        elif cfg.fused_gate_up:
            mlp = dict(zip(("gate", "up"), split_rows(linear(p + "mlp.gate_up_proj"), cfg.intermediate_size, cfg.intermediate_size)))
        elif cfg.gated_mlp:
            mlp = dict(gate=linear(p + "mlp.gate_proj"), up=linear(p + "mlp.up_proj"))
        else:
            mlp = dict(gate=None, up=linear(p + "mlp.up_proj"))
        if not cfg.layer_is_sparse(i):
            mlp["down"] = linear(p + "mlp.down_proj")
        norms = {place: norm(p + name if name else None) for place, name in cfg.spec.norm_names.items()}
        layers.append(
            LayerWeights(
                q=q, k=k, v=v, o=linear(p + "self_attn.o_proj"),
                **_qk_norms(cfg, p, norm), **norms, **mlp,
                sinks=vector(p + "self_attn.sinks") if cfg.attention_sinks else None,
                activation_params=cfg.spec.layer_activation(vector, p), **latent,
            )
        )
    embed = linear("model.embed_tokens")
    lm_head = embed if cfg.tie_word_embeddings else linear("lm_head")
    return Weights(dtype, embed, layers, norm("model.norm"), lm_head)


def _qk_norms(cfg: ModelConfig, p: str, norm) -> dict:
    """A layer's q_norm and k_norm: the stored ones, or ones for a norm without weights (Llama 4's)."""
    if cfg.qk_norm == "weightless":
        return dict(q_norm=np.ones(cfg.head_dim, np.float32), k_norm=np.ones(cfg.head_dim, np.float32))
    return dict(q_norm=norm(p + "self_attn.q_norm"), k_norm=norm(p + "self_attn.k_norm"))


def _latent_attention(cfg: ModelConfig, p: str, shapes: dict, matrix, norm) -> dict:
    """A latent attention layer's LayerWeights fields (p: its `self_attn.` prefix): q, k and v as
    the forward pass reads them from the latents (latent_rows), the latents' matrices and norms;
    k and v from kv_b_proj, or from llama.cpp's k_b_proj and v_b_proj (tensor_names.latent_shapes)."""
    q_source = p + ("q_b_proj" if cfg.q_lora_rank else "q_proj") + ".weight"
    split = p + "k_b_proj.weight" in shapes
    k_source, v_source = (p + "k_b_proj.weight", p + "v_b_proj.weight") if split else (p + "kv_b_proj.weight",) * 2
    return dict(q=matrix(q_source, latent_rows(cfg, "q")), k=matrix(k_source, latent_rows(cfg, "k", split)),
                v=matrix(v_source, latent_rows(cfg, "v", split)),
                q_a=matrix(p + "q_a_proj.weight") if cfg.q_lora_rank else None, q_a_norm=norm(p + "q_a_layernorm") if cfg.q_lora_rank else None,
                kv_a=matrix(p + "kv_a_proj_with_mqa.weight", latent_rows(cfg, "kv_a")), kv_a_norm=norm(p + "kv_a_layernorm"))


def _experts(cfg: ModelConfig, i: int, shapes: dict, linear, vector, stacked, transposed=None, mxfp4=None) -> dict:
    """A sparse layer's LayerWeights fields: the router (float32, so every precision routes as
    transformers does; the shared expert's gate as its last row), the experts (from any of
    tensor_names.EXPERT_LAYOUTS), and the shared expert as the layer's gate, up and down (None
    without one)."""
    stacked_names = router_name(cfg, i) not in shapes
    moe = moe_prefix(cfg, i, stacked=stacked_names)
    router = vector(router_name(cfg, i, stacked=stacked_names))
    shared = dict(gate=None, up=None, down=None)
    if cfg.shared_expert_intermediate_size:
        if cfg.spec.shared_expert_gate:
            router = np.concatenate([router, vector(moe + "shared_expert_gate.weight")])
        shared = {kind: linear(moe + cfg.spec.shared_expert_prefix + f"{kind}_proj") for kind in ("gate", "up", "down")}
    I = cfg.expert_intermediate_size
    fused = next((suffix for suffix in ("", ".weight") if moe + STACKED_GATE_UP + suffix in shapes), None)  # transformers 5's, llama.cpp's
    packed = moe + STACKED_GATE_UP + "_blocks" in shapes
    if cfg.router_bias and (fused == "" or packed):  # gpt-oss: gate and up interleaved, with biases; transposed or MXFP4
        gate_up_bias, down_bias = vector(moe + STACKED_GATE_UP + "_bias"), vector(moe + STACKED_DOWN + "_bias")
        read = mxfp4 if packed else transposed
        gates, ups = read(moe + STACKED_GATE_UP, (slice(0, None, 2), slice(1, None, 2)))
        (downs,) = read(moe + STACKED_DOWN, (slice(None),))
        experts = list(zip(gates, ups, downs))
        for e, (gate, up, down) in enumerate(experts):
            gate.b, up.b, down.b = gate_up_bias[e, 0::2].copy(), gate_up_bias[e, 1::2].copy(), down_bias[e]
    elif fused == "" and cfg.spec.transposed_experts:  # Llama 4: transposed, gate's columns then up's
        gates, ups = transposed(moe + STACKED_GATE_UP, (slice(0, I), slice(I, 2 * I)))
        (downs,) = transposed(moe + STACKED_DOWN, (slice(None),))
        experts = list(zip(gates, ups, downs))
    elif fused is not None:
        pairs = zip(stacked(moe + STACKED_GATE_UP + fused), stacked(moe + STACKED_DOWN + fused))
        experts = [(*split_rows(gate_up, I, I), down) for gate_up, down in pairs]
    elif moe + "experts.gate_proj.weight" in shapes:  # llama.cpp
        experts = list(zip(*(stacked(moe + f"experts.{kind}_proj.weight") for kind in ("gate", "up", "down"))))
        if cfg.router_bias:  # gpt-oss
            biases = [vector(moe + f"experts.{kind}_proj.bias") for kind in ("gate", "up", "down")]
            for e, expert in enumerate(experts):
                for lin, bias in zip(expert, biases):
                    lin.b = bias[e]
    else:
        experts = [tuple(linear(expert_matrix(cfg, i, e, kind)[: -len(".weight")]) for kind in ("gate", "up", "down"))
                   for e in range(cfg.num_experts)]
    w = aligned_empty(router.shape, np.float32)
    w[...] = router
    bias = vector(moe + "router.bias") if cfg.router_bias else None
    selection = vector(moe + cfg.spec.selection_bias_tensor).reshape(-1) if cfg.selection_bias else None
    return dict(router=Linear(w, F.F32, b=bias), experts=experts, selection_bias=selection, **shared)


def split_rows(lin: Linear, *sizes: int) -> list[Linear]:
    """A fused Linear cut into consecutive row blocks (views: rows of a C-contiguous matrix)."""
    if lin.format.group_of and any(n % F.GROUP_ROWS for n in sizes):
        raise CheckpointError(f"a fused matrix's parts {sizes} are not whole groups of {F.GROUP_ROWS} rows, as grouped blocks need; use --dtype float32")
    parts, start = [], 0
    for n in sizes:
        rows = slice(start, start + n)
        scales = lin.scales[rows] if lin.scales is not None else None
        parts.append(Linear(lin.w[rows], lin.format, scales, None if lin.b is None else lin.b[rows]))
        start += n
    return parts


def pack(read_rows, shape: tuple[int, int], dtype: str, path, name: str, check_finite: bool = False) -> Linear:
    """A 2-D tensor converted to the load precision `dtype` (or "q8_0", matrix_format), rows read as
    float32 by read_rows(start, stop) in chunks, so conversion needs no full float32 copy."""
    from .. import kernels as K

    N, Kdim = shape
    scales = None
    if dtype == "float32":
        w = aligned_empty((N, Kdim), np.float32)
    elif dtype == "bfloat16":
        w = aligned_empty((N, Kdim), np.uint16)
    elif dtype == "int8":
        w = aligned_empty((N, Kdim), np.int8)
        scales = np.empty((N, -(-Kdim // K.QBLOCK)), np.uint16)
    else:  # q4_0, or q8_0 for q4_0's output matrix (matrix_format)
        if Kdim % K.QBLOCK:
            raise CheckpointError(f"{path}: tensor {name!r} rows of {Kdim} are not whole blocks of 32, as {dtype} needs")
        fmt = F.BY_NAME[dtype.upper()]
        w = aligned_empty((N, fmt.row_bytes(Kdim)), np.uint8)
    for r0, r1 in _row_chunks(N, Kdim):
        rows = read_rows(r0, r1)
        if check_finite:
            require_finite(rows, path, name)
        if dtype == "int8" and not np.abs(rows).max(initial=0.0) <= K.INT8_MAX_WEIGHT:
            raise CheckpointError(
                f"{path}: tensor {name!r} has weights beyond {K.INT8_MAX_WEIGHT:.3g} (or NaN), "
                "more than int8's float16 scales can hold; load it as float32 or bfloat16"
            )
        if dtype == "float32":
            w[r0:r1] = rows
        elif dtype == "bfloat16":
            K.to_bf16(w[r0:r1], np.ascontiguousarray(rows))
        elif dtype == "int8":
            K.quantize_int8(w[r0:r1], scales[r0:r1], np.ascontiguousarray(rows))
        elif dtype == "q4_0":
            K.quantize_q4_0(w[r0:r1], np.ascontiguousarray(rows, dtype=np.float32))
        else:
            K.quantize_q8_0(w[r0:r1], np.ascontiguousarray(rows, dtype=np.float32))
    if dtype in ("q4_0", "q8_0"):
        return runnable_blocks(w, F.BY_NAME[dtype.upper()])
    return Linear(w, F.BY_NAME[F.LOAD_DTYPES[dtype]], scales)


def runnable_blocks(w: np.ndarray, fmt: F.WeightFormat, group: bool = True) -> Linear:
    """GGUF blocks (uint8 rows) as the kernels run them. Q4_0, Q8_0, Q4_K and Q6_K in whole groups
    of 16 rows are regrouped (kernels.grouped_layouts; unless `group` is False): the same bytes,
    interleaved so that integer dot products take 16 rows at once (Q4_0 matrices ~3x faster at
    decode). A Q8_0 matrix left is split into int8 levels and float16 scales, the I8 format: the
    same weights, which meet int16 activations in one vpmaddwd per block (1.2B shape decode ~1.9x
    the Q8_0 blocks read in place). The other formats run as stored."""
    from .. import kernels as K

    runs_as = F.runnable(fmt, w.shape[0]) if group else fmt
    if runs_as is not fmt:
        grouped = aligned_empty(w.shape, np.uint8)  # the same bytes, regrouped
        step = max(F.GROUP_ROWS, CONVERT_CHUNK // max(w.shape[1] * 2, 1) // F.GROUP_ROWS * F.GROUP_ROWS)
        for r0 in range(0, w.shape[0], step):
            K.group_rows(grouped[r0 : r0 + step], w[r0 : r0 + step], fmt.ggml_type)
            release_pages(w[r0 : r0 + step])
        return Linear(grouped, runs_as)
    if fmt.name == "Q8_0":
        N, blocks = w.shape[0], w.shape[1] // K.Q8_0_BYTES
        q, s = aligned_empty((N, blocks * K.QBLOCK), np.int8), np.empty((N, blocks), np.uint16)
        for r0, r1 in _row_chunks(N, blocks * K.QBLOCK):
            K.split_q8_0(q[r0:r1], s[r0:r1], w[r0:r1])
            release_pages(w[r0:r1])  # the file's pages just read: the copy replaces them
        return Linear(q, F.I8, s)
    return Linear(w, fmt)


def on_cache_lines(w: np.ndarray) -> np.ndarray:
    """w itself if its data starts on a cache line (cache.aligned_empty), else an aligned copy made
    in row chunks, the pages of each chunk of a memory-mapped w given back once copied."""
    if w.ctypes.data % CACHE_LINE == 0:
        return w
    out = aligned_empty(w.shape, w.dtype)
    for r0, r1 in _row_chunks(w.shape[0], w.shape[1]):
        out[r0:r1] = w[r0:r1]
        release_pages(w[r0:r1])
    return out


def matrix_format(cfg: ModelConfig, dtype: str, name: str) -> str:
    """The precision one matrix is packed at: `dtype`, except that q4_0 keeps the output matrix (the
    LM head, or the embeddings tied to it) at Q8_0, as llama.cpp's quantizer does (it takes Q6_K
    where rows are whole blocks of 256, Q8_0 otherwise; 4-bit logits cost twice the perplexity)."""
    output = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    return "q8_0" if dtype == "q4_0" and name == output else dtype


def _row_chunks(N: int, Kdim: int):
    """(start, stop) row ranges of about CONVERT_CHUNK elements each."""
    step = max(1, CONVERT_CHUNK // max(Kdim, 1))
    for r0 in range(0, N, step):
        yield r0, min(N, r0 + step)


def _check_finite(f: SafetensorsFile, name: str, arr: np.ndarray | None) -> None:
    """A stored tensor checked in row chunks (arr: its float32 view, else read and widened)."""
    for r0, r1 in _row_chunks(*f.tensors[name].shape):
        require_finite(arr[r0:r1] if arr is not None else f.read_rows(name, r0, r1), f.path, name)


def require_finite(values: np.ndarray, path, name: str) -> None:
    """The one NaN/Inf check of weights (--check-weights)."""
    if not np.isfinite(values).all():
        raise CheckpointError(f"{path}: tensor {name!r} contains NaN or Inf")

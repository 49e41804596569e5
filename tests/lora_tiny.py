"""PEFT LoRA adapters on tiny random checkpoints (hf_tiny), with their oracle: transformers + peft."""

from __future__ import annotations

import torch


def make_adapter(path, base, seed=1, **options):
    """Save a random LoRA adapter on the transformers model `base` (make_checkpoint's) to `path`;
    returns the PEFT model in float32. options: peft.LoraConfig's (r, lora_alpha, target_modules,
    use_rslora, rank_pattern, alpha_pattern, ...). B is random too (PEFT starts it at zero), so
    every update shows."""
    from peft import LoraConfig, get_peft_model

    settings = dict(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)
    settings.update(options)
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(**settings))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(path)
    return model


def with_adapters(base_dir, adapter_dirs):
    """transformers + peft: the checkpoint at base_dir with every adapter in adapter_dirs active at
    once (their updates summed), float32."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    names = [f"adapter{i}" for i in range(len(adapter_dirs))]
    model = PeftModel.from_pretrained(model, str(adapter_dirs[0]), adapter_name=names[0])
    for path, name in zip(adapter_dirs[1:], names[1:]):
        model.load_adapter(str(path), adapter_name=name)
    model.base_model.set_adapter(names)
    return model.eval()


def unload(peft_model):
    """The base transformers model back, without its adapter (PEFT wraps it in place)."""
    return peft_model.unload()


def stored_as(adapter_dir, dtype):
    """Rewrite a saved adapter's tensors in `dtype` (torch.bfloat16, torch.float16), as adapters
    trained or saved in half precision ship."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    path = Path(adapter_dir) / "adapter_model.safetensors"
    save_file({k: v.to(dtype) for k, v in load_file(str(path)).items()}, str(path))


def rounded_to(peft_model, dtype):
    """The adapter's weights rounded to `dtype` and kept float32: the oracle of its stored_as file."""
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(p.to(dtype).float())


def write_gguf_adapter(adapter_dir, path, arch: str, layers: int, heads: int, kv_heads: int, dtype="float32"):
    """A PEFT adapter as llama.cpp's convert_lora_to_gguf.py writes it: general.type "adapter",
    adapter.lora.alpha, `<base GGUF name>.weight.lora_a` / `.lora_b` float32, the B rows of Q and
    K permuted as the converter permutes Llama's base Q and K."""
    import json
    from pathlib import Path

    import gguf
    from gguf_tiny import PERMUTED_QK, permute

    settings = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    assert not settings.get("use_rslora") and not settings.get("rank_pattern") and not settings.get("alpha_pattern")
    arch_id = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(arch_id, layers)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(settings["lora_alpha"]))
    from safetensors.torch import load_file as load_torch

    for key, tensor in sorted(load_torch(str(Path(adapter_dir) / "adapter_model.safetensors")).items()):
        t = tensor.float().numpy()
        module, part = key.removeprefix("base_model.model.").split(".lora_")
        part = "lora_" + part.split(".")[0].lower()
        if part == "lora_b" and arch in PERMUTED_QK and module.endswith(("q_proj", "k_proj")):
            t = permute(t, heads if module.endswith("q_proj") else kv_heads)
        writer.add_tensor(f"{names.get_name(module)}.weight.{part}", t.astype(dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

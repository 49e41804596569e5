"""Tiny reasoning models for the tests: a random Qwen3 or gpt-oss body with a word-level tokenizer
whose vocabulary holds the markers (`<think>`, Harmony's `<|channel|>`...), a chat template in the
model's style, and a scripted sampler that makes the engine write a chosen reply."""

from __future__ import annotations

import json
from pathlib import Path

from hf_tiny import make_checkpoint

WORDS = ["hello", "the", "answer", "is", "42", "let", "me", "think", "about", "it", "so", "weather", "in", "oslo", "user", "assistant",
         "system", "final", "analysis", "commentary", "json", "to=functions.get_weather", '{"city":', '"Oslo"}', "sunny", "ok", "Reasoning:",
         "low", "medium", "high", "Question", "."]
QWEN3_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN3_MARKERS = ["<think>", "</think>"]  # added tokens that decode as text, as Qwen3's
HARMONY_SPECIAL = ["<|startoftext|>", "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]

# Qwen3's switch: enable_thinking false writes an empty thinking block at the generation prompt
QWEN3_TEMPLATE = """{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.role == 'assistant' and m.reasoning_content %}<think>
{{ m.reasoning_content }}
</think>

{% endif %}{{ m.content }}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

# an R1 distill's: the template opens the thinking itself
OPENED_TEMPLATE = QWEN3_TEMPLATE.replace("{% if enable_thinking is defined", "<think>\n{% if false and enable_thinking is defined")

HARMONY_TEMPLATE = """<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>
{%- for m in messages %}{% if m.role == 'assistant' %}{% if m.tool_calls %}{% for c in m.tool_calls %}<|start|>assistant<|channel|>commentary to=functions.{{ c.function.name }} <|constrain|>json<|message|>{{ c.function.arguments | tojson }}<|call|>{% endfor %}{% else %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{% endif %}{% elif m.role == 'tool' %}<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}{% if tools %}{% endif %}"""


def make_reasoning_model(path: Path, kind: str) -> Path:
    """A tiny model directory: kind "qwen3", "opened" (a template-opened <think>) or "gpt_oss"."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    harmony = kind == "gpt_oss"
    special = HARMONY_SPECIAL if harmony else QWEN3_SPECIAL
    vocab = {w: i for i, w in enumerate(["[UNK]", *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(special)
    if not harmony:
        tokenizer.add_tokens(QWEN3_MARKERS)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    overrides = dict(vocab_size=size, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, head_dim=8,
                     sliding_window=8) if harmony else dict(vocab_size=size, head_dim=8)
    make_checkpoint(path, arch="gpt_oss" if harmony else "qwen3", **overrides)
    tokenizer.save(str(path / "tokenizer.json"))
    eos = "<|return|>" if harmony else "<|im_end|>"
    template = HARMONY_TEMPLATE if harmony else (OPENED_TEMPLATE if kind == "opened" else QWEN3_TEMPLATE)
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos, "chat_template": template}))
    eos_ids = [tokenizer.token_to_id(t) for t in (["<|return|>", "<|call|>"] if harmony else ["<|im_end|>"])]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    return path


class ScriptedSampler:
    """Stands in for minillm.core.engine.sample: each request writes `script` (token ids), one a
    step, by its count of generated tokens; a token masked to -inf (a grammar, a thinking
    budget's forced marker) is not written, and the script jumps to just past that forced token's
    next place in it (the model moving on) or, if absent, stays."""

    def __init__(self, script: list[int]):
        self.script = script
        self.offsets: dict[int, int] = {}  # id(generated list) -> script index shift

    def __call__(self, logits, params, rng, history=(), generated=()):
        import numpy as np

        key = id(generated)
        at = len(generated) + self.offsets.get(key, 0)
        wanted = self.script[at] if at < len(self.script) else self.script[-1]
        if np.isfinite(logits[wanted]):
            return int(wanted)
        forced = int(np.argmax(logits))
        later = [i for i in range(at, len(self.script)) if self.script[i] == forced]
        if later:
            self.offsets[key] = self.offsets.get(key, 0) + later[0] - at
        else:
            self.offsets[key] = self.offsets.get(key, 0) - 1
        return forced


def ids(tokenizer_dir: Path, text: str) -> list[int]:
    """Token ids of `text` (words and markers apart by spaces) in that model's vocabulary."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    return tok.encode(text, add_special_tokens=False).ids

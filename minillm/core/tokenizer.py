"""Tokenizer (the `tokenizers` library over tokenizer.json) and chat templates (sandboxed Jinja)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from ..errors import TokenizerError


# fill-in-the-middle markers: StarCoder and SmolLM's, Qwen2.5-Coder's, CodeLlama's, DeepSeek-Coder's
FIM_MARKERS = (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"), ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
               ("▁<PRE>", "▁<SUF>", "▁<MID>"), ("<PRE>", "<SUF>", "<MID>"), ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"))


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except FileNotFoundError:
            raise TokenizerError(f"{path}: no such file") from None
        except Exception as e:  # tokenizers raises its own exception type for malformed files
            raise TokenizerError(f"{path}: cannot load tokenizer: {_first_line(e)}") from None

        config = _read_json(model_dir / "tokenizer_config.json")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.add_bos = bool(config.get("add_bos_token", False)) and self.bos_id is not None
        self.chat_template = _chat_template(model_dir, config)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; BOS prepended once when the tokenizer asks for it and the text lacks it."""
        try:
            ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        except Exception as e:
            raise TokenizerError(f"cannot encode text: {_first_line(e)}") from None
        if add_special_tokens and self.add_bos and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        try:
            return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        except Exception as e:
            raise TokenizerError(f"cannot decode ids: {_first_line(e)}") from None

    def token_id(self, text: str) -> int | None:
        return self._tok.token_to_id(text)

    @property
    def fill_in_middle(self) -> tuple[int, int, int] | None:
        """The (prefix, suffix, middle) marker ids of a tokenizer whose model was trained to fill in
        the middle, by the names code models give them; None without them."""
        for names in FIM_MARKERS:
            ids = [self.token_id(name) for name in names]
            if None not in ids:
                return tuple(ids)
        return None

    def encode_infill(self, prefix: str, suffix: str) -> list[int]:
        """The prompt that asks for the text between `prefix` and `suffix` (prefix-suffix-middle
        order, as the models trained on it read it): prefix marker, prefix, suffix marker, suffix,
        middle marker; BOS first when the tokenizer asks for it."""
        pre, suf, mid = self.fill_in_middle
        ids = [pre] + self.encode(prefix, add_special_tokens=False) + [suf] + self.encode(suffix, add_special_tokens=False) + [mid]
        return [self.bos_id] + ids if self.add_bos else ids

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders a `tools` list (as transformers passes it)."""
        return bool(self.chat_template) and "tools" in self.chat_template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                            variables: dict | None = None, continue_final: bool = False) -> str:
        """Render `messages` (and `tools`, for templates that take them) with the model's template
        in Jinja's immutable sandbox; `variables`: more for the template (chat_template_kwargs).
        continue_final: the text ends where the final message's content does, so the model
        continues that message (as transformers' continue_final_message cuts it)."""
        if continue_final:
            return self._continued(messages, tools, variables)
        if not self.chat_template:
            raise TokenizerError("this model has no chat template (tokenizer_config.json: 'chat_template')")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise TokenizerError("each chat message needs a string 'role'")
            if not isinstance(m.get("content"), str) and not (m.get("content") is None and m.get("tool_calls")):
                raise TokenizerError("each chat message needs a string 'content' (or tool_calls)")
        template = _compile_template(self.chat_template)
        from jinja2.exceptions import SecurityError
        from jinja2.exceptions import TemplateError as JinjaError

        try:
            return template.render(
                **(variables or {}),
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except SecurityError as e:
            raise TokenizerError(f"chat template blocked by the sandbox: {e}") from None
        except JinjaError as e:
            raise TokenizerError(f"chat template failed: {e}") from None
        except Exception as e:  # a template can raise anything a filter raises
            raise TokenizerError(f"chat template failed: {type(e).__name__}: {e}") from None

    def _continued(self, messages: list[dict], tools: list[dict] | None, variables: dict | None) -> str:
        final = messages[-1].get("content") or ""
        text = self.apply_chat_template(messages, False, tools, variables)
        for content in (final, final.strip()):
            at = text.rfind(content) if content else -1
            if at >= 0:
                return text[: at + len(content)]
        raise TokenizerError("the chat template does not write the final assistant message as given, so it cannot be continued")

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                    variables: dict | None = None, continue_final: bool = False) -> list[int]:
        # The template writes any BOS itself: encoding without special tokens avoids a double BOS.
        text = self.apply_chat_template(messages, add_generation_prompt, tools, variables, continue_final)
        return self.encode(text, add_special_tokens=False)


def _compile_template(source: str):
    from jinja2.exceptions import TemplateError as JinjaError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TokenizerError(f"chat template: {message}")

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    # The same environment settings as transformers, so templates render identically.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.filters["tojson"] = lambda obj, indent=None: json.dumps(obj, ensure_ascii=False, indent=indent)
    try:
        return env.from_string(source)
    except JinjaError as e:
        raise TokenizerError(f"chat template does not parse: {e}") from None


def _chat_template(model_dir: Path, config: dict) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"  # transformers v5 writes the template here
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"{model_dir / 'tokenizer_config.json'}: field 'chat_template' must be a string")
    return template


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise TokenizerError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return data


def _token_text(value) -> str | None:
    """tokenizer_config.json spells special tokens as a string or as an AddedToken object."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__

"""One exception hierarchy for everything minillm rejects.

The library raises these; only the CLI turns them into a one-line message and exit code 2.
"""


class MiniLLMError(Exception):
    """Base of every error caused by bad input (files, settings, prompts)."""


class ConfigError(MiniLLMError):
    """config.json is missing, malformed, or asks for something we do not support."""


class CheckpointError(MiniLLMError):
    """A weight file is missing, malformed, or disagrees with the config."""


class GGUFError(MiniLLMError):
    """A GGUF file cannot be imported."""


class TokenizerError(MiniLLMError):
    """tokenizer.json / tokenizer_config.json / the chat template cannot be used."""


class GenerationError(MiniLLMError):
    """A request cannot be served: bad sampling settings, prompt too long, NaN logits."""


class ContextLengthError(GenerationError):
    """The prompt (or the prompt plus the tokens asked for) does not fit the context.
    `param` names what to shorten: "prompt" or "max_tokens"."""

    def __init__(self, message: str, param: str = "prompt"):
        super().__init__(message)
        self.param = param


class UsageError(MiniLLMError):
    """A malformed command-line value, e.g. `--tokens 1,x,3`."""


class HubError(MiniLLMError):
    """A model named as ORG/NAME[:QUANT] cannot be found, reached or downloaded."""

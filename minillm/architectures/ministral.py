"""Ministral (Mistral's 3B and 8B): Mistral whose layers slide or attend fully as layer_types says
(every layer sliding when it says nothing)."""

from .llama import Mistral


class Ministral(Mistral):
    hf_names = ("MinistralForCausalLM",)
    docs = ("before, `x * w`", "-", "SiLU gate", "sliding and full layers (`layer_types`)", "as Llama")

"""Speculative decoding by prompt lookup against plain decoding, on input-grounded and open-ended tasks.

    python benchmarks/speculative.py [--model PATH] [--dtype D] [--rounds 5] [--tokens 160]

Each task is a chat to the model whose reply, greedy, either repeats its input (copying a
paragraph, renaming a variable in code, correcting a few words, quoting a document to answer) or
does not (open-ended continuation). Each round runs every task through two engines over the same
weights, plain and `speculative="ngram"`, alternating which goes first; decode tokens/s is timed
from the first token to the last. Reported per task: medians over rounds, the ratio, the share of
proposed tokens accepted, and whether the texts were identical (they must be).
Benchmarks are not tests: nothing here runs under pytest.
"""

from __future__ import annotations

import argparse
import statistics
import time

import minillm
from minillm.core.engine import Engine
from minillm.core.sampling import SamplingParams

PARAGRAPH = ("minillm is a CPU inference engine for Llama-family language models, written in Python on NumPy and "
             "Numba. Its kernels are compiled for your CPU on the first run and loaded from Numba's cache after. It "
             "reads Hugging Face checkpoints and GGUF files as stored, serves an OpenAI-compatible API with continuous "
             "batching and a prefix cache, and gives the same logits as transformers at float32.")
CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax
'''
TASKS = {
    "copy a paragraph": f"Repeat this paragraph exactly, word for word:\n\n{PARAGRAPH}",
    "rename in code": f"Rewrite this Python function with the variable `subtotal` renamed to `net`. Reply with the code only.\n\n{CODE}",
    "fix typos": "Correct the spelling in this text and return the whole corrected text:\n\n" + PARAGRAPH.replace("engine", "engnie")
                 .replace("compiled", "compilled").replace("prefix", "prefx"),
    "open-ended": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def decode_rate(engine: Engine, prompt: list[int], tokens: int):
    times, out = [], []
    for event in engine.submit(prompt, SamplingParams(temperature=0), tokens, engine_eos):
        times.append(time.perf_counter())
        out.append(event.token)
    return (len(out) - 1) / (times[-1] - times[0]) if len(out) > 1 else float("nan"), out


def main() -> None:
    global engine_eos
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--dtype")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--spec-tokens", type=int, default=8)
    args = ap.parse_args()
    llm = minillm.load(args.model, dtype=args.dtype, ctx=2048, cache_mb=0)
    engine_eos = llm.eos_ids
    plain = Engine(llm.model, llm.options.replace(max_batch=1, cache_mb=0))
    spec = Engine(llm.model, llm.options.replace(max_batch=1, cache_mb=0, speculative="ngram", spec_tokens=args.spec_tokens))
    prompts = {name: llm.tokenizer.encode_chat([{"role": "user", "content": text}]) for name, text in TASKS.items()}
    rates = {name: {"plain": [], "ngram": []} for name in TASKS}
    accepted = {name: [0, 0] for name in TASKS}
    same = {name: True for name in TASKS}
    lengths = {}
    for r in range(args.rounds):
        for name, prompt in prompts.items():
            order = [("plain", plain), ("ngram", spec)] if r % 2 == 0 else [("ngram", spec), ("plain", plain)]
            outs = {}
            for mode, engine in order:
                before = (engine.stats.spec_draft_tokens, engine.stats.spec_accepted_tokens)
                rate, outs[mode] = decode_rate(engine, prompt, args.tokens)
                rates[name][mode].append(rate)
                if mode == "ngram":
                    accepted[name][0] += engine.stats.spec_draft_tokens - before[0]
                    accepted[name][1] += engine.stats.spec_accepted_tokens - before[1]
            same[name] &= outs["plain"] == outs["ngram"]
            lengths[name] = len(outs["plain"])
    print(f"{args.rounds} alternating rounds, greedy, up to {args.tokens} tokens, medians of decode tok/s from the first token")
    print(f"{'task':18} {'tokens':>6} {'plain':>7} {'ngram':>7} {'ratio':>6} {'accepted':>9}  text")
    for name in TASKS:
        p, s = statistics.median(rates[name]["plain"]), statistics.median(rates[name]["ngram"])
        proposed, kept = accepted[name]
        share = f"{kept / proposed:.0%}" if proposed else "-"
        print(f"{name:18} {lengths[name]:6d} {p:7.1f} {s:7.1f} {s / p:6.2f} {share:>9}  {'identical' if same[name] else 'DIFFERS'}")


engine_eos: tuple = ()

if __name__ == "__main__":
    main()

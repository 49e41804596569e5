"""Speculative decoding by prompt lookup against plain decoding, on input-grounded and open-ended tasks.

    python benchmarks/speculative.py [--model PATH] [--dtype D] [--activations 16|8] [--rounds 5] [--tokens 160]
                                     [--modes ngram draft prediction] [--draft-dtype int8 [q4_0 ...]]

Each task is a chat to the model whose reply, greedy, either repeats its input (copying a
paragraph, renaming a variable in code, correcting a few words, quoting a document to answer) or
does not (open-ended continuation). Each round runs every task through engines over the same
weights, plain and each of --modes (`ngram`: prompt lookup; `draft`: the same model at
each --draft-dtype proposing; `prediction`: no speculation, but each request given the text its
task quotes as OpenAI's predicted output, which prompt lookup then proposes from), in an order that rotates; decode tokens/s is timed from the first token
to the last. Reported per task: medians over rounds, the ratio, the share of
proposed tokens accepted, whether the texts were identical (they must be), and lookup's ceiling:
plain decoding's text replayed through prompt lookup with rows that cost nothing (it proposes
--spec-tokens every step), tokens per step, which no row cost can beat; with --oracle-row-cost C,
what lookup would reach were it to propose exactly what will be kept, each row costing C of a step.
Benchmarks are not tests: nothing here runs under pytest.
"""

from __future__ import annotations

import argparse
import statistics
import time

import minillm
from minillm.core.engine import Engine
from minillm.core.model import Model
from minillm.core.sampling import SamplingParams
from minillm.core.speculative import PromptLookup
from minillm.options import DEFAULT_SPEC_NGRAM

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
MODULE = '''import json
from dataclasses import dataclass


@dataclass
class Item:
    name: str
    price: float
    quantity: int


def load_items(path):
    with open(path) as f:
        rows = json.load(f)
    return [Item(row["name"], row["price"], row["quantity"]) for row in rows]


def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best


def report(items, tax_rate):
    lines = [f"{item.name}: {item.quantity} x {item.price:.2f}" for item in items]
    lines.append(f"total: {total_price(items, tax_rate):.2f}")
    return "\n".join(lines)
'''
DOCUMENT = ("Order confirmation\n\nThank you for your order, Maria Lindqvist. Your order number is 48213-KX and it "
            "was placed on 14 March 2026. We will ship it to 12 Harbour Street, Bergen, Norway, within three working "
            "days. Questions? Write to support@example.com and quote your order number. The total charged to your "
            "card was 1,249.00 NOK, including VAT.")
TYPOS = PARAGRAPH.replace("engine", "engnie").replace("compiled", "compilled").replace("prefix", "prefx")
TASKS = {
    "copy a paragraph": f"Repeat this paragraph exactly, word for word:\n\n{PARAGRAPH}",
    "rename in code": f"Rewrite this Python function with the variable `subtotal` renamed to `net`. Reply with the code only.\n\n{CODE}",
    "rename in a module": f"Rewrite this Python module with the variable `items` renamed to `products` everywhere. Reply with the code only.\n\n{MODULE}",
    "extract as JSON": "From this document, extract the customer name, order number, date, address and total as a JSON object. "
                       f"Reply with the JSON only.\n\n{DOCUMENT}",
    "fix typos": f"Correct the spelling in this text and return the whole corrected text:\n\n{TYPOS}",
    "open-ended": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}
# what a client would send as the predicted output: the text the task quotes
PREDICTIONS = {"copy a paragraph": PARAGRAPH, "rename in code": CODE, "rename in a module": MODULE, "extract as JSON": DOCUMENT,
               "fix typos": TYPOS, "open-ended": ""}


def decode_rate(engine: Engine, prompt: list[int], tokens: int, prediction: list[int] = ()):
    times, out = [], []
    for event in engine.submit(prompt, SamplingParams(temperature=0), tokens, engine_eos, prediction=prediction):
        times.append(time.perf_counter())
        out.append(event.token)
    return (len(out) - 1) / (times[-1] - times[0]) if len(out) > 1 else float("nan"), out


def lookup_ceiling(prompt: list[int], out: list[int], most: int, row_cost: float = 0.0) -> float:
    """Tokens per step were checked rows free: plain decoding's text `out` replayed through
    PromptLookup at row cost 0 (then it always proposes `most`), the first token from the prompt's
    step not counted. With row_cost c > 0: the speed-up over plain decoding of an oracle that
    proposes exactly the tokens of those matches that will be kept, each row costing c of a step."""
    lookup = PromptLookup(prompt, most, DEFAULT_SPEC_NGRAM)
    lookup.extend(out[:1])
    i, steps, rows = 1, 0, 0
    while i < len(out):
        draft = lookup.propose(len(out) - i - 1, 0.0)
        kept = 0
        while kept < len(draft) and draft[kept] == out[i + kept]:
            kept += 1
        lookup.extend(out[i : i + kept + 1])
        lookup.update(len(draft), kept)
        i, steps, rows = i + kept + 1, steps + 1, rows + kept
    return (len(out) - 1) / (steps + row_cost * rows) if steps else float("nan")


def main() -> None:
    global engine_eos
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--dtype")
    ap.add_argument("--activations", type=int, default=16, help="8: a GGUF file's grouped matrices met by 8-bit activations")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--spec-tokens", type=int, default=8)
    ap.add_argument("--modes", nargs="+", default=["ngram"], choices=["ngram", "draft", "prediction"])
    ap.add_argument("--draft-dtype", nargs="+", default=["int8"], help="one draft column per precision")
    ap.add_argument("--oracle-row-cost", type=float, metavar="C",
                    help="also print lookup's best at a checked row's cost C (a fraction of a step): an oracle column")
    args = ap.parse_args()
    llm = minillm.load(args.model, dtype=args.dtype, ctx=2048, cache_mb=0, activations=args.activations)
    engine_eos = llm.eos_ids
    base = llm.options.replace(max_batch=1, cache_mb=0)
    engines = {"plain": Engine(llm.model, base)}
    if "ngram" in args.modes:
        engines["ngram"] = Engine(llm.model, base.replace(speculative="ngram", spec_tokens=args.spec_tokens))
    if "draft" in args.modes:
        for dtype in args.draft_dtype:
            draft = Model.load(llm.source, ctx=llm.model.ctx, dtype=dtype, activations=args.activations)
            name = "draft" if len(args.draft_dtype) == 1 else dtype
            engines[name] = Engine(llm.model, base.replace(speculative="draft", spec_tokens=args.spec_tokens), draft=draft)
    if "prediction" in args.modes:
        engines["prediction"] = Engine(llm.model, base)  # no speculation: the requests' predictions alone
    prompts = {name: llm.tokenizer.encode_chat([{"role": "user", "content": text}]) for name, text in TASKS.items()}
    predictions = {name: llm.tokenizer.encode(text, add_special_tokens=False) if text else [] for name, text in PREDICTIONS.items()}
    rates = {name: {mode: [] for mode in engines} for name in TASKS}
    counts = {name: {mode: [0, 0] for mode in engines} for name in TASKS}
    same = {name: True for name in TASKS}
    plain_texts = {}
    modes = list(engines)
    for r in range(args.rounds):
        order = modes[r % len(modes):] + modes[: r % len(modes)]
        for name, prompt in prompts.items():
            outs = {}
            for mode in order:
                engine = engines[mode]
                before = (engine.stats.spec_draft_tokens, engine.stats.spec_accepted_tokens)
                rate, outs[mode] = decode_rate(engine, prompt, args.tokens, predictions[name] if mode == "prediction" else ())
                rates[name][mode].append(rate)
                counts[name][mode][0] += engine.stats.spec_draft_tokens - before[0]
                counts[name][mode][1] += engine.stats.spec_accepted_tokens - before[1]
            same[name] &= all(out == outs["plain"] for out in outs.values())
            plain_texts[name] = outs["plain"]  # greedy: the same every round
    ceilings = {name: lookup_ceiling(prompts[name], text, args.spec_tokens) for name, text in plain_texts.items()}
    c = args.oracle_row_cost
    oracles = {name: lookup_ceiling(prompts[name], text, args.spec_tokens, c) for name, text in plain_texts.items()} if c else {}
    print(f"{args.rounds} rounds, greedy, up to {args.tokens} tokens, medians of decode tok/s from the first token"
          + (f"; draft: the model at {', '.join(args.draft_dtype)}" if "draft" in args.modes else ""))
    header = f"{'task':18} {'tokens':>6} {'plain':>7}" + "".join(f" {m:>7} {'ratio':>6} {'kept':>5}" for m in modes[1:])
    print(header + "  text       ceiling" + (f"  oracle@{c}" if oracles else ""))
    for name in TASKS:
        plain = statistics.median(rates[name]["plain"])
        line = f"{name:18} {len(plain_texts[name]):6d} {plain:7.1f}"
        for mode in modes[1:]:
            rate = statistics.median(rates[name][mode])
            proposed, kept = counts[name][mode]
            line += f" {rate:7.1f} {rate / plain:6.2f} {(f'{kept / proposed:.0%}' if proposed else '-'):>5}"
        oracle = f"  {oracles[name]:9.2f}" if oracles else ""
        print(line + f"  {'identical' if same[name] else 'DIFFERS':9}  {ceilings[name]:7.2f}" + oracle)


engine_eos: tuple = ()

if __name__ == "__main__":
    main()

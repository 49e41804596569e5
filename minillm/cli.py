"""minillm's command line: parses arguments and calls the library.

    python cli.py generate   [--model DIR|FILE.gguf] --prompt TEXT [--max-tokens N] [sampling flags]
    python cli.py chat       [--model DIR] [--prompt TEXT] [--system TEXT]
    python cli.py logits     [--model DIR] --tokens 1,2,3 --out FILE.npy
    python cli.py compare    [--model DIR] [--prompt TEXT | --tokens 1,2,3] [--per-layer [--plot FILE]] [--json]
    python cli.py perplexity [--model DIR] --file TEXT [--ctx N] [--stride S] [--dtypes D ...] [--hf] [--plot FILE] [--json]
    python cli.py bench      [--model DIR] [--prompt-tokens P] [--gen-tokens G] [--json]
    python cli.py serve      [--model DIR] [--port 8000] [--max-batch N] [--api-key KEY]
    python cli.py warmup     [--model PATH | --dtype D | --formats F ...]
    python cli.py import     FILE.gguf DIR
    python cli.py pull       ORG/NAME[:QUANT] [--revision REV]
    python cli.py list
    python cli.py rm         ORG/NAME[:QUANT]

--model takes a checkpoint directory, a GGUF file or a Hugging Face Hub name (ORG/NAME,
ORG/NAME:QUANT), which is downloaded once into the Hub's cache.

Any error is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

EXIT_ERROR = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        raise SystemExit(_fail(f"{self.prog}: {message}"))


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return EXIT_ERROR


def _model_flags(p, several: bool = False) -> None:
    """Every command that loads a model: which, at what precision and context, on how many threads
    (several: serve's --model, repeatable as NAME=PATH_OR_REPO)."""
    from minillm.kernels.formats import DTYPE_CHOICES, KV_DTYPE_CHOICES
    from minillm.options import Options

    if several:
        p.add_argument("--model", metavar="[NAME=]PATH|REPO", action="append",
                       help=Options.help("model") + "; repeat as NAME=PATH_OR_REPO to serve several, each loaded on first use")
        p.add_argument("--models-dir", metavar="DIR", help="serve every GGUF file and checkpoint directory in DIR, named by its file name")
    else:
        p.add_argument("--model", metavar="PATH|NAME", help=Options.help("model"))
    p.add_argument("--revision", metavar="REV", help=Options.help("revision"))
    p.add_argument("--ctx", type=int, metavar="N", help=Options.help("ctx"))
    p.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        help="weight precision: a directory's default float32 is exact (the logits transformers gives); "
        "bfloat16, int8 and q4_0 read a half, a quarter and an eighth of the bytes per token. A GGUF "
        "runs as stored by default (gguf), exactly its dequantized weights' logits",
    )
    p.add_argument("--check-weights", action="store_true", help=Options.help("check_weights"))
    p.add_argument("--threads", type=int, metavar="N", help=Options.help("threads"))
    p.add_argument("--kv-dtype", choices=KV_DTYPE_CHOICES, help=Options.help("kv_dtype"))
    p.add_argument("--activations", type=int, choices=[16, 8], help=Options.help("activations"))
    p.add_argument("--lora", action="append", metavar="[NAME=]PATH[:SCALE]", help=Options.help("lora"))


def _speculative_flags(p) -> None:
    """The commands that decode through the engine: speculative decoding (minillm.core.speculative)."""
    from minillm.options import Options

    p.add_argument("--speculative", choices=["ngram", "draft"], help=Options.help("speculative"))
    p.add_argument("--draft-model", metavar="PATH|NAME", help=Options.help("draft_model"))
    p.add_argument("--draft-dtype", metavar="D", help=Options.help("draft_dtype"))
    p.add_argument("--spec-tokens", type=int, metavar="K", help=Options.help("spec_tokens"))
    p.add_argument("--spec-ngram", type=int, metavar="N", help=Options.help("spec_ngram"))


def _sampling_flags(p, max_tokens=256) -> None:
    """Sampling defaults follow llama.cpp's."""
    p.add_argument("--max-tokens", type=int, default=max_tokens, metavar="N")
    p.add_argument("--temperature", type=float, default=0.8, metavar="T", help="0 means greedy")
    p.add_argument("--top-k", type=int, default=40, metavar="K", help="0 disables")
    p.add_argument("--top-p", type=float, default=0.95, metavar="P", help="1 disables")
    p.add_argument("--min-p", type=float, default=0.05, metavar="P", help="0 disables")
    p.add_argument("--repeat-penalty", type=float, default=1.0, metavar="R", help="1 disables")
    p.add_argument("--seed", type=int, metavar="S", help="same seed, same text")
    p.add_argument("--stop", nargs="+", action="extend", default=[], metavar="STR", help="stop before these strings")
    p.add_argument("--truncate", action="store_true", help="keep the most recent tokens of a prompt longer than the context")


def _text_commands(sub) -> None:
    from minillm.options import Options

    g = sub.add_parser("generate", help="continue a prompt; only the generated text goes to stdout")
    _model_flags(g)
    _speculative_flags(g)
    given = g.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt")
    given.add_argument("--prompt-file", metavar="PATH", help="the prompt's text from a file, as it is ('-': standard input)")
    _sampling_flags(g)

    c = sub.add_parser("chat", help="interactive multi-turn chat through the model's chat template")
    _model_flags(c)
    _speculative_flags(c)
    c.add_argument("--prompt", help="answer this one message and exit")
    c.add_argument("--system", help="a system message")
    _template_flags(c)
    c.add_argument("--show-thinking", action="store_true", help="a reasoning model's thinking on stderr as it comes (dimmed on a terminal)")
    c.add_argument("--thinking-budget", type=int, metavar="N", help="thinking tokens before the model is made to answer")
    c.add_argument("--no-thinking", action="store_true", help="switch a reasoning model's thinking off")
    c.add_argument("--cache-dir", metavar="DIR", help=Options.help("cache_dir"))
    _sampling_flags(c, max_tokens=512)


def _template_flags(p) -> None:
    """The chat template and how replies are read (chat, serve)."""
    from minillm.options import DEFAULTS, Options

    p.add_argument("--chat-template", metavar="FILE", help=Options.help("chat_template"))
    p.add_argument("--chat-template-kwargs", metavar="JSON", help=Options.help("chat_template_kwargs"))
    p.add_argument("--reasoning-format", choices=["auto", "none"], default=DEFAULTS.reasoning_format, help=Options.help("reasoning_format"))


def _analysis_commands(sub) -> None:
    """logits, compare (against transformers), perplexity, bench."""
    from minillm.kernels.formats import DTYPE_CHOICES

    lg = sub.add_parser("logits", help="float32 logits [T, vocab] for every position of a token sequence")
    _model_flags(lg)
    lg.add_argument("--tokens", required=True, metavar="1,2,3")
    lg.add_argument("--out", required=True, metavar="FILE.npy")

    cmp = sub.add_parser("compare", help="minillm against transformers: logit metrics per position, per layer")
    _model_flags(cmp)
    src = cmp.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="text to run (default: a built-in sentence)")
    src.add_argument("--tokens", metavar="1,2,3")
    cmp.add_argument("--per-layer", action="store_true", help="hidden-state difference after every layer")
    cmp.add_argument("--threshold", type=float, default=1e-4, help="relative L2 error that counts as divergence")
    cmp.add_argument("--json", action="store_true", help="one JSON object on stdout (schema in docs/models.md)")
    cmp.add_argument("--plot", metavar="FILE", help="with --per-layer: draw the divergence per layer (.png or .svg; needs minillm[plot])")

    ppl = sub.add_parser("perplexity", help="perplexity over a text file with sliding windows of --ctx tokens")
    _model_flags(ppl)
    ppl.add_argument("--file", required=True, metavar="TEXT")
    ppl.add_argument("--stride", type=int, metavar="S", help="tokens between windows (default: half the window)")
    ppl.add_argument("--hf", action="store_true", help="also run transformers on the very same windows")
    ppl.add_argument("--json", action="store_true")
    ppl.add_argument("--dtypes", nargs="+", choices=DTYPE_CHOICES, metavar="D", help="run at each of these precisions (default: --dtype)")
    ppl.add_argument("--plot", metavar="FILE", help="draw the perplexity of each precision (.png or .svg; needs minillm[plot])")

    b = sub.add_parser("bench", help="prefill and decode speed, time to first token, load time, peak RSS")
    _model_flags(b)
    b.add_argument("--prompt-tokens", type=int, default=128, metavar="P")
    b.add_argument("--gen-tokens", type=int, default=128, metavar="G")
    b.add_argument("--json", action="store_true", help="one JSON object on stdout")
    b.add_argument("--prompt-file", metavar="TEXT", help="decode after this text instead of random tokens (e.g. a document to repeat, for --speculative)")
    _speculative_flags(b)


def _setup_commands(sub) -> None:
    """warmup and import."""
    from minillm.kernels.formats import DTYPE_CHOICES, KV_DTYPE_CHOICES

    wu = sub.add_parser("warmup", help="compile the kernels for this CPU ahead of time (images, replicas), then exit")
    what = wu.add_mutually_exclusive_group()
    what.add_argument("--model", metavar="PATH|NAME", help="what this model needs (default: the bundled model at float32)")
    what.add_argument("--dtype", choices=[d for d in DTYPE_CHOICES if d != "gguf"], help="what a checkpoint loaded at this precision needs")
    what.add_argument("--formats", nargs="+", metavar="F", help="these weight formats (a GGUF's: Q4_0, Q4_K, Q6_K, Q8_0, ..)")
    wu.add_argument("--kv-dtype", choices=KV_DTYPE_CHOICES, default="float32", help="and the forward pass for this KV cache format")
    wu.add_argument("--activations", type=int, choices=[16, 8], help="the grouped layouts' kernels for activations of these bits (default: each format's own)")
    wu.add_argument("--experts", action="store_true", help="and the steps of a mixture of experts (Mixtral, Qwen-MoE, OLMoE)")
    wu.add_argument("--gpt-oss", action="store_true", help="and gpt-oss's steps (experts, attention sinks, clamped SwiGLU)")

    ml = sub.add_parser("merge-lora", help="merge LoRA adapters into a checkpoint directory's weights, written as a new directory")
    ml.add_argument("--model", required=True, metavar="DIR", help="the base checkpoint directory (safetensors)")
    ml.add_argument("--lora", required=True, action="append", metavar="PATH[:SCALE]", help="a PEFT adapter directory or GGUF adapter, repeatable")
    ml.add_argument("--out", required=True, metavar="DIR", help="the merged checkpoint's directory (must not exist)")

    im = sub.add_parser("import", help="import a Llama-architecture GGUF file as an HF-format directory")
    im.add_argument("gguf", metavar="FILE.gguf")
    im.add_argument("dest", metavar="DIR")

    # models by name, in the Hugging Face Hub's cache (minillm.loading.hub)
    pl = sub.add_parser("pull", help="download a Hub model (ORG/NAME, or ORG/NAME:QUANT for a GGUF repository's file) into the cache")
    pl.add_argument("name", metavar="ORG/NAME[:QUANT]")
    pl.add_argument("--revision", metavar="REV", help="a branch, tag or commit (default: main)")
    sub.add_parser("list", help="the Hub models in the cache, with their sizes")
    rm = sub.add_parser("rm", help="delete a model from the cache (ORG/NAME:QUANT: only that quantization's files)")
    rm.add_argument("names", nargs="+", metavar="ORG/NAME[:QUANT]")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="minillm", description="CPU inference for Llama-family models.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _text_commands(sub)
    _analysis_commands(sub)
    _serve_flags(sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching"))
    _setup_commands(sub)
    return parser


def _sampling(args) -> dict:
    return dict(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repeat_penalty,
        seed=args.seed,
    )


def _options(args):
    """The minillm.options.Options the flags give (the ones a command has)."""
    from dataclasses import fields

    from minillm.options import Options

    names = {f.name for f in fields(Options)}
    given = {k: tuple(v) if isinstance(v, list) else v for k, v in vars(args).items() if k in names and v is not None}
    return Options(**given)


def _load(args):
    import minillm

    return minillm.load(options=_options(args))


def _write(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


def _read_text(path: str, flag: str) -> str:
    """A text file as it is ('-': standard input); a one-line error naming the flag if unreadable."""
    from minillm import UsageError

    try:
        if path == "-":
            return sys.stdin.read()
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{flag}: cannot read {path}: {e}") from None


def cmd_generate(args) -> int:
    prompt = args.prompt if args.prompt is not None else _read_text(args.prompt_file, "--prompt-file")
    llm = _load(args)
    stream = llm.stream(prompt, max_tokens=args.max_tokens, stop=args.stop, truncate=args.truncate, **_sampling(args))
    for piece in stream:
        _write(piece)
    if sys.stdout.isatty():
        _write("\n")
    if stream.finish_reason == "context":
        print("note: generation stopped at the end of the context", file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    from minillm import UsageError

    if args.thinking_budget is not None and (args.thinking_budget < 0 or args.no_thinking):
        raise UsageError("--thinking-budget must be >= 0, and without --no-thinking")
    llm = _load(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    thinking = {"thinking": not args.no_thinking, "thinking_budget": args.thinking_budget}
    dim, plain = ("\033[2m", "\033[0m") if sys.stderr.isatty() else ("", "")

    def turn(text: str) -> None:
        history.append({"role": "user", "content": text})
        stream = llm.chat_stream(history, max_tokens=args.max_tokens, stop=args.stop, truncate=args.truncate, **thinking, **_sampling(args))
        reply, thought = [], False
        for parts in stream.parts():
            if parts.reasoning and args.show_thinking:
                print(dim + parts.reasoning + plain, end="", file=sys.stderr, flush=True)
                thought = True
            if parts.content:
                if thought:  # the thinking ends on a line of its own
                    print(file=sys.stderr, flush=True)
                    thought = False
                reply.append(parts.content)
                _write(parts.content)
        _write("\n")
        answer = {"role": "assistant", "content": "".join(reply)}
        history.append(dict(answer, reasoning_content=stream.reasoning) if stream.reasoning else answer)

    if args.prompt is not None:
        turn(args.prompt)
        return 0
    interactive = sys.stdin.isatty()
    if interactive:
        print("chat: type a message; /reset clears the history, /exit or Ctrl-D quits", file=sys.stderr)
    while True:
        if interactive:
            print(">>> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            del history[1 if args.system else 0 :]
            continue
        if line.strip():
            turn(line.rstrip("\n"))


def cmd_logits(args) -> int:
    import numpy as np

    tokens = _tokens_arg(args.tokens)
    llm = _load(args)
    logits = llm.logits(tokens)
    out = args.out if args.out.endswith(".npy") else args.out + ".npy"
    tmp = f"{out}.tmp-{os.getpid()}.npy"
    try:
        np.save(tmp, logits.astype(np.float32))
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    print(f"wrote {out}: float32 {list(logits.shape)}", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    import json

    from minillm import UsageError
    from minillm.bench import run

    if args.prompt_tokens < 1 or args.gen_tokens < 0:
        raise UsageError("--prompt-tokens must be >= 1 and --gen-tokens >= 0")
    from minillm.loading.hub import model_path

    args.model = str(model_path(args.model, args.revision))
    prompt = None
    if args.prompt_file:
        text = _read_text(args.prompt_file, "--prompt-file")
        from minillm.api import tokenizer_files
        from minillm.core.tokenizer import Tokenizer

        prompt = Tokenizer(tokenizer_files(args.model)[0]).encode(text)
    result = run(args.model, args.dtype, args.prompt_tokens, args.gen_tokens, ctx=args.ctx, speculation=_options(args), prompt=prompt,
                 kv_dtype=args.kv_dtype or "float32", lora=tuple(args.lora or ()), activations=args.activations)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"model        {result['model']} ({result['dtype']}, {result['weight_mb']:.0f} MiB of weights)")
    print(f"prefill      {result['prefill_tok_s']:.1f} tok/s ({result['prompt_tokens']} tokens)")
    if args.gen_tokens:
        print(f"decode       {result['decode_tok_s']:.1f} tok/s ({args.gen_tokens} tokens)")
    if "spec_decode_tok_s" in result:
        print(f"speculative  {result['spec_decode_tok_s']:.1f} tok/s through the engine, against {result['engine_decode_tok_s']:.1f} without "
              f"({result['spec_speedup']:.2f}x; {result['spec_accepted_tokens']} of {result['spec_draft_tokens']} proposed tokens accepted)")
    print(f"first token  {result['ttft_s'] * 1000:.1f} ms")
    print(f"KV cache     {result['kv_dtype']}, {result['kv_bytes_per_token'] / 1024:.1f} KiB per token of context ({result['ctx']} positions)")
    print(f"load         {result['load_s']:.2f} s (+ {result['warmup_s']:.2f} s kernel warm-up)")
    print(f"peak RSS     {result['peak_rss_mb']:.0f} MiB")
    return 0


COMPARE_PROMPT = "The quick brown fox jumps over the lazy dog. In 1969, people first walked on the Moon."


def _tokens_arg(text: str) -> list[int]:
    from minillm import UsageError

    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise UsageError(f"--tokens must be comma-separated integers, got {text!r}") from None


def cmd_compare(args) -> int:
    import json

    from minillm import UsageError
    from minillm.compare import compare, load_oracle
    from minillm.loading.lora import parse_lora_spec

    if args.plot and not args.per_layer:
        raise UsageError("--plot draws the per-layer divergence: add --per-layer")
    if args.plot:
        from minillm.plots import check_plot

        check_plot(args.plot)
    llm = _load(args)
    tokens = _tokens_arg(args.tokens) if args.tokens else llm.tokenizer.encode(args.prompt or COMPARE_PROMPT)
    llm.check_prompt(tokens)
    adapters = [a.path for a in llm.adapters.values()]
    if any(path.suffix == ".gguf" for path in adapters) or any(parse_lora_spec(spec)[2] != 1 for spec in llm.options.lora):
        raise UsageError("compare --lora: peft runs PEFT adapter directories at their own scale (no GGUF adapters, no :SCALE)")
    oracle = load_oracle(llm.source, adapters)
    result = compare(llm.model, oracle, tokens, per_layer=args.per_layer, threshold=args.threshold, adapter=llm.adapter())
    if args.plot:
        from minillm.plots import plot_layers

        plot_layers(result["layers"], args.plot, title=f"{llm.source.name} ({result['dtype']}) vs transformers")
    if args.json:
        print(json.dumps(result))
        return 0
    o = result["overall"]
    print(f"minillm ({result['dtype']}) vs transformers (float32) on {result['tokens']} tokens")
    print(f"overall: max |dlogit| {o['max_abs']:.3g}, NMSE {o['nmse']:.3g}, top-1 agreement {o['top1'] * 100:.1f}%, "
          f"KL(hf||minillm) mean {o['kl_mean']:.3g} max {o['kl_max']:.3g} nats")
    print(f"{'position':>8} {'max_abs':>10} {'nmse':>10} {'top1':>5} {'kl':>10}")
    for p in result["positions"]:
        print(f"{p['position']:>8} {p['max_abs']:>10.3g} {p['nmse']:>10.3g} {'yes' if p['top1'] else 'NO':>5} {p['kl']:>10.3g}")
    if args.per_layer:
        layers = result["layers"]
        print(f"\nper layer (relative L2 error of the hidden state; divergence above {layers['threshold']:g}):")
        print(f"{'stage':>12} {'max_abs':>10} {'rel_l2':>10}")
        for st in layers["stages"]:
            mark = "  <- first divergence" if st["stage"] == layers["first_divergence"] else ""
            print(f"{st['stage']:>12} {st['max_abs']:>10.3g} {st['rel_l2']:>10.3g}{mark}")
        print(f"first divergence: {layers['first_divergence'] or 'none'}")
        for r in layers.get("routers", ()):
            print(f"router of layer {r['layer']}: the same experts for {r['same_experts'] * 100:.1f}% of tokens "
                  f"({r['same_choices'] * 100:.1f}% of choices)")
    return 0


def cmd_perplexity(args) -> int:
    import json

    from minillm import UsageError
    from minillm.compare import hf_window_scorer, load_oracle, model_window_scorer, perplexity

    try:
        text = open(args.file, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{args.file}: cannot read: {e}") from None
    if args.plot:
        from minillm.plots import check_plot

        check_plot(args.plot)
    dtypes = args.dtypes or [args.dtype]
    args.dtype = dtypes[0]
    llm = _load(args)
    dtypes[0] = args.dtype = llm.model.dtype  # a label for the default precision too
    ids = llm.tokenizer.encode(text)
    window = llm.model.ctx  # --ctx: each window is one full context
    stride = args.stride or max(1, window // 2)
    if not 0 < stride <= window <= llm.model.ctx or len(ids) < 2:
        raise UsageError(f"need 0 < stride ({stride}) <= window ({window}) <= context ({llm.model.ctx}) and a text of 2+ tokens")
    result = {"file": args.file, "dtype": args.dtype, "window": window, "stride": stride, "tokens": len(ids)}
    result["minillm"] = perplexity(model_window_scorer(llm.model), ids, window, stride, progress=not args.json)
    if len(dtypes) > 1:  # the first precision's run stays "minillm"; every run under "by_dtype"
        result["by_dtype"] = {args.dtype: result["minillm"]}
        for dtype in dtypes[1:]:
            args.dtype = dtype
            result["by_dtype"][dtype] = perplexity(model_window_scorer(_load(args).model), ids, window, stride, progress=not args.json)
        args.dtype = dtypes[0]
    if args.hf:
        result["transformers"] = perplexity(hf_window_scorer(load_oracle(llm.source)), ids, window, stride, progress=not args.json)
    if args.plot:
        from minillm.plots import plot_perplexity

        runs = result.get("by_dtype", {args.dtype: result["minillm"]})
        plot_perplexity({d: r["perplexity"] for d, r in runs.items()}, args.plot,
                        reference=result["transformers"]["perplexity"] if args.hf else None,
                        title=f"{Path(args.file).name}: windows of {window} every {stride}")
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{args.file}: {len(ids)} tokens, windows of {window} every {stride} ({result['minillm']['windows']} windows)")
    for dtype, run in result.get("by_dtype", {args.dtype: result["minillm"]}).items():
        print(f"minillm ({dtype}):  perplexity {run['perplexity']:.4f}")
    if args.hf:
        hf = result["transformers"]["perplexity"]
        rel = result["minillm"]["perplexity"] / hf - 1
        print(f"transformers (float32): perplexity {hf:.4f}  (minillm {rel * 100:+.3f}%)")
    return 0


def _serve_flags(sv) -> None:
    """The serve command's flags: the model's, the HTTP server's, and the cluster's (--replicas);
    defaults and help from minillm.options.Options."""
    from minillm.options import DEFAULTS, Options

    _model_flags(sv, several=True)
    _speculative_flags(sv)
    _template_flags(sv)
    sv.add_argument("--host", default=DEFAULTS.host)
    sv.add_argument("--port", type=int, default=DEFAULTS.port)
    sv.add_argument("--max-batch", type=int, default=DEFAULTS.max_batch, metavar="N", help=Options.help("max_batch"))
    sv.add_argument("--max-queue", type=int, default=DEFAULTS.max_queue, metavar="N", help=Options.help("max_queue"))
    sv.add_argument("--api-key", metavar="KEY", help=Options.help("api_key"))
    sv.add_argument("--allow-runtime-lora", action="store_true", default=None, help=Options.help("allow_runtime_lora"))
    sv.add_argument("--shutdown-timeout", type=float, default=DEFAULTS.shutdown_timeout, metavar="S", help=Options.help("shutdown_timeout"))
    sv.add_argument("--cache-mb", type=float, metavar="MB", help=Options.help("cache_mb"))
    sv.add_argument("--cache-dir", metavar="DIR", help=Options.help("cache_dir"))
    sv.add_argument("--prefill-chunk", type=int, metavar="N", help=Options.help("prefill_chunk"))
    sv.add_argument("--max-body-mb", type=float, default=DEFAULTS.max_body_mb, metavar="MB", help=Options.help("max_body_mb"))
    sv.add_argument("--allowed-hosts", metavar="NAMES", help=Options.help("allowed_hosts"))
    sv.add_argument("--allowed-origins", metavar="ORIGINS", help=Options.help("allowed_origins"))
    sv.add_argument("--model-name", help=Options.help("model_name"))
    sv.add_argument("--idle-unload", type=float, metavar="SECONDS", help=Options.help("idle_unload"))
    sv.add_argument("--max-loaded", type=int, metavar="N", help=Options.help("max_loaded"))
    sv.add_argument("--max-loaded-mb", type=float, metavar="MB", help=Options.help("max_loaded_mb"))
    sv.add_argument("--replicas", type=int, metavar="N", help=Options.help("replicas"))
    sv.add_argument("--threads-per-replica", type=int, metavar="T", help="CPUs and Numba threads per replica (default 1)")
    sv.add_argument("--autoscale", metavar="MIN:MAX", type=_autoscale, help=Options.help("autoscale"))
    sv.add_argument("--ingress-replicas", type=int, metavar="N", help=Options.help("ingress_replicas"))
    sv.add_argument("--ray-address", metavar="ADDR", help=Options.help("ray_address"))


def cmd_serve(args) -> int:
    from minillm import UsageError

    for flag in ("threads_per_replica", "ingress_replicas"):  # cluster flags on a single server
        if getattr(args, flag) is not None and not (args.replicas or args.autoscale or args.ray_address):
            raise UsageError(f"--{flag.replace('_', '-')} needs --replicas, --autoscale or --ray-address")
    if args.threads_per_replica is not None:
        args.threads = args.threads_per_replica
    specs, args.model = args.model or [], None
    several = args.models_dir is not None or len(specs) > 1 or any("=" in spec for spec in specs)
    if args.lora and (several or args.replicas or args.autoscale or args.ray_address):
        raise UsageError("--lora serves adapters of one model on one server: give one --model, without --replicas")
    if not several and specs:
        args.model = specs[0]
    options = _options(args)

    def ready(names=None):
        precision = f" ({options.dtype})" if options.dtype else ""
        where = f" on {options.replicas or 'autoscaled'} Ray Serve replicas" if options.clustered else ""
        served = ", ".join(names) if names else options.served_name
        loaded = " (each loaded on first use)" if several else ""
        print(f"minillm serving {served}{precision}{where}{loaded} on http://{options.host}:{options.port}/v1", file=sys.stderr)

    if options.clustered:
        from minillm.serving.cluster import require_ray, run

        if several:
            raise UsageError("--replicas serves one model: give one --model")
        require_ray()
        run(options, on_ready=ready)
        return 0

    import minillm
    from minillm.serving.server import serve

    error = serve(lambda opts: minillm.load(options=opts), options, on_ready=ready, specs=specs if several else None,
                  models_dir=args.models_dir)
    if error is not None:
        raise error
    return 0


def _autoscale(text: str) -> tuple[int, int]:
    try:
        low, high = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--autoscale takes MIN:MAX, got {text!r}") from None
    return low, high


def cmd_warmup(args) -> int:
    from minillm.warmup import formats_for, warm

    if args.model is not None:
        import time

        import minillm

        start = time.perf_counter()
        minillm.load(args.model, kv_dtype=args.kv_dtype, activations=args.activations)
        print(f"kernels for {args.model} ready in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        return 0
    formats = formats_for(None if args.formats else args.dtype or "float32", args.formats or (), args.activations)
    seconds = warm(formats, args.kv_dtype, args.experts, args.gpt_oss)
    print(f"kernels for {', '.join(f.name for f in formats)} ready in {seconds:.1f} s", file=sys.stderr)
    return 0


def cmd_import(args) -> int:
    from minillm.loading.gguf_import import import_gguf

    dest = import_gguf(args.gguf, args.dest)
    print(f"imported {args.gguf} into {dest}", file=sys.stderr)
    return 0


def cmd_merge_lora(args) -> int:
    from minillm.loading.lora import parse_lora_spec
    from minillm.loading.lora_merge import merge_lora

    adapters = []
    for spec in args.lora:
        _, path, scale = parse_lora_spec(spec)
        adapters.append((path, scale))
    out = merge_lora(args.model, adapters, args.out)
    print(f"merged {len(adapters)} adapter{'s' if len(adapters) > 1 else ''} into {out}", file=sys.stderr)
    return 0


def cmd_pull(args) -> int:
    from minillm.loading.hub import ModelName, resolve

    if ModelName.parse(args.name) is None:
        raise _usage(f"pull: {args.name!r} is not a model name (ORG/NAME or ORG/NAME:QUANT)")
    path = resolve(args.name, args.revision)
    print(path)  # where it is: what --model could also be given
    return 0


def cmd_list(args) -> int:
    from minillm.loading.hub import Hub, age, cached_models

    hub = Hub.from_environment()
    models = cached_models(hub)
    if not models:
        print(f"no models in {hub.cache_dir} (fetch one: minillm pull ORG/NAME)", file=sys.stderr)
        return 0
    width = max(len(m.name) for m in models)
    print(f"{'NAME':<{width}}  {'SIZE':>9}  MODIFIED")
    for m in models:
        print(f"{m.name:<{width}}  {_size(m.size):>9}  {age(m.modified)}")
    return 0


def cmd_rm(args) -> int:
    from minillm.loading.hub import remove

    for name in args.names:
        for gone in remove(name):
            print(f"deleted {gone}", file=sys.stderr)
    return 0


def _size(nbytes: int) -> str:
    """Decimal units, as Ollama's and the Hub's listings show sizes."""
    scale, unit = next(((s, u) for s, u in ((1e9, "GB"), (1e6, "MB"), (1e3, "KB")) if nbytes >= s), (1, "B"))
    return f"{nbytes / scale:.1f} {unit}" if scale > 1 else f"{nbytes} B"


def _usage(message: str):
    from minillm import UsageError

    return UsageError(message)


COMMANDS = {
    "generate": cmd_generate,
    "chat": cmd_chat,
    "logits": cmd_logits,
    "compare": cmd_compare,
    "perplexity": cmd_perplexity,
    "bench": cmd_bench,
    "serve": cmd_serve,
    "warmup": cmd_warmup,
    "import": cmd_import,
    "merge-lora": cmd_merge_lora,
    "pull": cmd_pull,
    "list": cmd_list,
    "rm": cmd_rm,
}


def main(argv=None) -> int:
    args = _build_parser().parse_args(argv)
    from minillm import MiniLLMError

    if args.command not in ("import", "pull", "list", "rm"):  # every other command runs the kernels
        from minillm.kernels.jit import load_numba_registries

        load_numba_registries()  # without SciPy's BLAS and cffi: ~20 MB less at peak

    try:
        return COMMANDS[args.command](args)
    except MiniLLMError as e:
        return _fail(str(e))
    except OSError as e:  # an unwritable --out, a full disk, a closed pipe
        return _fail(f"{e.strerror or e}: {e.filename}" if e.filename else str(e))
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

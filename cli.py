"""minillm's command line: parses arguments and calls the library.

    python cli.py generate [--model DIR] --prompt TEXT [--max-tokens N] [sampling flags]
    python cli.py chat [--model DIR] [--prompt TEXT]
    python cli.py logits [--model DIR] --tokens 1,2,3 --out FILE.npy
    python cli.py import FILE.gguf DIR

Any error is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys

EXIT_ERROR = 2
DTYPES = ("float32", "bfloat16", "int8")  # minillm.checkpoint.DTYPES, without importing numba to parse flags


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        raise SystemExit(_fail(f"{self.prog}: {message}"))


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return EXIT_ERROR


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="minillm", description="CPU inference for Llama-family models.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def model_flags(p):
        p.add_argument("--model", metavar="DIR", help="HF checkpoint directory (default: the bundled SmolLM2-135M-Instruct)")
        p.add_argument("--ctx", type=int, metavar="N", help="context size (default: min(max positions, 4096))")
        p.add_argument(
            "--dtype",
            choices=DTYPES,
            default="float32",
            help="weight precision (default float32: exact, the logits transformers gives; "
            "bfloat16 halves and int8 quarters the weight bytes read per token)",
        )

    def sampling_flags(p, max_tokens=256):
        p.add_argument("--max-tokens", type=int, default=max_tokens, metavar="N")
        p.add_argument("--temperature", type=float, default=0.8, metavar="T", help="0 means greedy")
        p.add_argument("--top-k", type=int, default=40, metavar="K", help="0 disables")
        p.add_argument("--top-p", type=float, default=0.95, metavar="P", help="1 disables")
        p.add_argument("--min-p", type=float, default=0.05, metavar="P", help="0 disables")
        p.add_argument("--repeat-penalty", type=float, default=1.0, metavar="R", help="1 disables")
        p.add_argument("--seed", type=int, metavar="S", help="same seed, same text")
        p.add_argument("--stop", nargs="+", action="extend", default=[], metavar="STR", help="stop before these strings")

    g = sub.add_parser("generate", help="continue a prompt; only the generated text goes to stdout")
    model_flags(g)
    g.add_argument("--prompt", required=True)
    sampling_flags(g)

    c = sub.add_parser("chat", help="interactive multi-turn chat through the model's chat template")
    model_flags(c)
    c.add_argument("--prompt", help="answer this one message and exit")
    c.add_argument("--system", help="a system message")
    sampling_flags(c, max_tokens=512)

    lg = sub.add_parser("logits", help="float32 logits [T, vocab] for every position of a token sequence")
    model_flags(lg)
    lg.add_argument("--tokens", required=True, metavar="1,2,3")
    lg.add_argument("--out", required=True, metavar="FILE.npy")

    b = sub.add_parser("bench", help="prefill and decode speed, time to first token, load time, peak RSS")
    model_flags(b)
    b.add_argument("--prompt-tokens", type=int, default=128, metavar="P")
    b.add_argument("--gen-tokens", type=int, default=128, metavar="G")
    b.add_argument("--json", action="store_true", help="one JSON object on stdout")

    im = sub.add_parser("import", help="import a Llama-architecture GGUF file as an HF-format directory")
    im.add_argument("gguf", metavar="FILE.gguf")
    im.add_argument("dest", metavar="DIR")
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


def _load(args):
    import minillm

    return minillm.load(args.model, ctx=args.ctx, dtype=args.dtype)


def _write(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


def cmd_generate(args) -> int:
    llm = _load(args)
    stream = llm.stream(args.prompt, max_tokens=args.max_tokens, stop=args.stop, **_sampling(args))
    for piece in stream:
        _write(piece)
    if sys.stdout.isatty():
        _write("\n")
    if stream.finish_reason == "context":
        print("note: generation stopped at the end of the context", file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    llm = _load(args)
    history = [{"role": "system", "content": args.system}] if args.system else []

    def turn(text: str) -> None:
        history.append({"role": "user", "content": text})
        stream = llm.chat_stream(history, max_tokens=args.max_tokens, stop=args.stop, **_sampling(args))
        reply = []
        for piece in stream:
            reply.append(piece)
            _write(piece)
        _write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})

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

    from minillm import UsageError

    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        raise UsageError(f"--tokens must be comma-separated integers, got {args.tokens!r}") from None
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
    if args.model is None:
        from minillm.default_model import default_model_dir

        args.model = str(default_model_dir())
    result = run(args.model, args.dtype, args.prompt_tokens, args.gen_tokens, ctx=args.ctx)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"model        {result['model']} ({args.dtype}, {result['weight_mb']:.0f} MiB of weights)")
    print(f"prefill      {result['prefill_tok_s']:.1f} tok/s ({args.prompt_tokens} tokens)")
    if args.gen_tokens:
        print(f"decode       {result['decode_tok_s']:.1f} tok/s ({args.gen_tokens} tokens)")
    print(f"first token  {result['ttft_s'] * 1000:.1f} ms")
    print(f"load         {result['load_s']:.2f} s (+ {result['warmup_s']:.2f} s kernel warm-up)")
    print(f"peak RSS     {result['peak_rss_mb']:.0f} MiB")
    return 0


def cmd_import(args) -> int:
    from minillm.gguf_import import import_gguf

    dest = import_gguf(args.gguf, args.dest)
    print(f"imported {args.gguf} into {dest}", file=sys.stderr)
    return 0


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "logits": cmd_logits, "bench": cmd_bench, "import": cmd_import}


def main(argv=None) -> int:
    args = _build_parser().parse_args(argv)
    from minillm import MiniLLMError

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

"""Server memory over many sequential mixed requests: stock mlx_lm.server vs mlx-h2o serve.

    python benchmarks/serve_memory.py [--requests 150] [--warmup 50] [--servers stock h2o]
        [--mix chat|varied] [--side-by-side] [--model PATH] [--server-args "..."]
        [--h2o-args "..."] [--seed 0]

Each server in turn is started on 127.0.0.1 (a free port) and sent the same
``--requests`` requests one after another, from shuffled prose. ``--mix
chat`` (the default): mostly the next turn (8-32 tokens) of one of 6 open
chats, whose caches the server fetches from its prompt cache, trims and
grows past the budget (a chat is left at 900 tokens); new chats of 64-384
tokens; short text completions; 1-4 generated tokens. ``--mix varied``:
prompts of 8-400 tokens, chat or text, every 7th the next turn of an earlier
chat; 1-16 generated tokens. Both: streamed or not, some seeded and sampled
(the one-at-a-time path), some with stop words or logprobs, and every 25th
a client that hangs up mid-stream. The server's
resident memory (/proc VmRSS) is read after each answer, and mlx-h2o
serve's MLX active memory (its /health; on a GPU, device memory). Memory is
flat when every reading after ``--warmup`` requests stays within 5% of the
reading at the warm-up's end. ``--side-by-side`` runs the servers at the same time (a
client each), so that the load of a shared machine hits them alike. Prints
a config header, a line per checkpoint, a summary table and a final JSON
line. Every server started is stopped.
"""

import argparse
import json
import os
import platform
import random
import shlex
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import MB, Server, unwind_on_sigterm  # noqa: E402
from serve_model import PROSE, model_info  # noqa: E402

FLAT = 0.05  # the largest rise over the warm-up's end that counts as flat


CHATS = 6  # conversations open at a time
CHAT_TOKENS = 900  # a conversation this long is left for a new one


def make_requests(tokenizer, n, seed, mix="chat"):
    """``n`` request bodies (path, body, hang_up) from one seed. ``mix``
    "chat": mostly the next turn of one of a few open chats (their caches
    fetched from the prompt cache, trimmed, grown past the budget), some new
    chats, some text; "varied": prompts of 8-400 tokens, chat or text, every
    7th the next turn of an earlier chat, 1-16 generated tokens."""
    rng = random.Random(seed)
    sentences = PROSE.read_text().replace("\n", " ").split(". ")

    def passage(tokens):
        rng.shuffle(sentences)
        ids = tokenizer.encode(". ".join(sentences), add_special_tokens=False).ids
        return tokenizer.decode(ids[:tokens])

    chats, out = [], []
    for i in range(n):
        path, body = (_varied if mix == "varied" else _chat_turn)(i, rng, passage, chats)
        if i % 5 == 1:
            body.update(stream=True, stream_options={"include_usage": True})
        if i % 11 == 4:
            body.update(seed=i, temperature=0.7, top_p=0.9)
        if i % 13 == 6:
            body.update(stop=["\n", "."], logprobs=True, top_logprobs=3)
        hang_up = i % 25 == 24
        if hang_up:
            body.update(stream=True, max_tokens=16)
        out.append((path, body, hang_up))
    return out


def _chat_turn(i, rng, passage, chats):
    """(path, body) of the chat mix; ``chats``: the open ones, [messages, tokens]."""
    body = {"max_tokens": rng.randint(1, 4), "temperature": 0.0}
    roll = rng.random()
    if roll < 0.1:
        return "/v1/completions", dict(body, prompt=passage(rng.choice((8, 16, 32, 64))))
    if roll < 0.3 or not chats:
        chat = [[], 0]
        chats[:] = chats[-(CHATS - 1):] + [chat]
        turn = rng.choice((64, 128, 256, 384))
    else:
        chat = rng.choice(chats)
        chat[0] = chat[0] + [{"role": "assistant", "content": "Sure, go on."}]
        turn = rng.choice((8, 16, 32))
    chat[0] = chat[0] + [{"role": "user", "content": passage(turn)}]
    chat[1] += turn + 12
    if chat[1] > CHAT_TOKENS:
        chats.remove(chat)
    return "/v1/chat/completions", dict(body, messages=chat[0])


def _varied(i, rng, passage, chats):
    """(path, body) of the varied mix; ``chats``: earlier chats, their answers."""
    text = passage(rng.choice((8, 16, 40, 80, 150, 250, 400)))
    body = {"max_tokens": rng.randint(1, 16), "temperature": 0.0}
    if i % 7 == 3 and chats:
        messages = rng.choice(chats) + [{"role": "user", "content": text[:200]}]
    else:
        messages = [{"role": "user", "content": text}]
    if rng.random() < 1 / 3:
        return "/v1/completions", dict(body, prompt=text)
    if len(chats) < 8:
        chats.append(messages + [{"role": "assistant", "content": "Yes."}])
    return "/v1/chat/completions", dict(body, messages=messages)


def send(srv, path, body, timeout):
    req = urllib.request.Request(srv.url(path), data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


def hang_up(srv, path, body, timeout):
    """A streamed request whose client leaves after its first data line."""
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=timeout) as sock:
        sock.sendall(head + data)
        reader = sock.makefile("rb")
        for line in iter(reader.readline, b""):
            if line.startswith(b"data:"):
                break
        reader.close()


def mlx_active_mb(srv):
    """The server's MLX active memory (mlx-h2o serve's /health); None if not told."""
    try:
        with urllib.request.urlopen(srv.url("/health"), timeout=30) as r:
            memory = json.loads(r.read()).get("mlx_memory")
    except (OSError, ValueError):
        return None
    return memory["active"] / MB if memory else None


def run_server(name, argv, requests, args, log):
    """{"rss": MB after each request, "mlx_active": MB after each (or None)}."""
    series = {"rss": [], "mlx_active": []}
    with Server(argv, log) as srv:
        srv.wait_ready(args.start_timeout)
        print(f"server {name}: pid={srv.proc.pid} ready_rss_mb={srv.status_mb('VmRSS'):.0f}",
              flush=True)
        start = time.monotonic()
        for i, (path, body, leaves) in enumerate(requests):
            (hang_up if leaves else send)(srv, path, body, args.timeout)
            series["rss"].append(srv.status_mb("VmRSS"))
            series["mlx_active"].append(mlx_active_mb(srv))
            if (i + 1) % args.every == 0 or i + 1 == len(requests):
                active = series["mlx_active"][-1]
                print(f"server={name} requests={i + 1} rss_mb={series['rss'][-1]:.0f} "
                      f"max_rss_mb={max(series['rss']):.0f} mlx_active_mb="
                      f"{'-' if active is None else f'{active:.0f}'} "
                      f"elapsed_s={time.monotonic() - start:.0f} "
                      f"load1={os.getloadavg()[0]:.1f}", flush=True)
    return series


def summary(values, warmup):
    """The first reading, the one at the warm-up's end, the last, the extremes
    after the warm-up, and whether they stay within FLAT of the warm-up's end."""
    if any(v is None for v in values):
        return None
    base, after = values[warmup - 1], values[warmup - 1:]
    return {"first_mb": values[0], "warm_mb": base, "last_mb": values[-1],
            "max_after_warmup_mb": max(after), "min_after_warmup_mb": min(after),
            "rise_after_warmup": max(after) / base - 1, "flat": max(after) <= base * (1 + FLAT),
            "mb": [round(v) for v in values]}


def print_table(results):
    print("| server | memory | after 1 | after warm-up | last | max after warm-up | rise | "
          "flat (<= 5%) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        for key, what in (("rss", "RSS"), ("mlx_active", "MLX active")):
            m = r[key]
            if m is not None:
                print(f"| {name} | {what} | {m['first_mb']:.0f} | {m['warm_mb']:.0f} | "
                      f"{m['last_mb']:.0f} | {m['max_after_warmup_mb']:.0f} | "
                      f"{100 * m['rise_after_warmup']:+.1f}% | "
                      f"{'yes' if m['flat'] else 'no'} |")


def setup_arg_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=150)
    p.add_argument("--warmup", type=int, default=50, help="requests before the reference")
    p.add_argument("--servers", nargs="+", default=["stock", "h2o"], choices=("stock", "h2o"))
    p.add_argument("--model", default=None, help="local mlx-lm model folder "
                   "(default: the packaged SmolLM2)")
    p.add_argument("--server-args", default="", help="extra flags for every server")
    p.add_argument("--h2o-args", default="", help="extra flags for mlx-h2o serve")
    p.add_argument("--every", type=int, default=25, help="requests between printed lines")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mix", default="chat", choices=("chat", "varied"),
                   help="chat: next turns of open chats; varied: prompts of 8-400 tokens")
    p.add_argument("--side-by-side", action="store_true",
                   help="run the servers at the same time, not one after the other")
    p.add_argument("--timeout", type=float, default=300, help="seconds a request may take")
    p.add_argument("--start-timeout", type=float, default=300, help="seconds to /health")
    return p


def main():
    args = setup_arg_parser().parse_args()
    if not 1 <= args.warmup <= args.requests:
        raise SystemExit("--warmup must be between 1 and --requests")
    unwind_on_sigterm()
    import mlx.core as mx
    import mlx_lm

    from mlx_h2o.models import resolve_model

    model = Path(args.model or resolve_model("smollm2-135m"))
    tok, *_ = model_info(model)
    requests = make_requests(tok, args.requests, args.seed, args.mix)
    common = shlex.split(args.server_args)
    argv = {"stock": ["-m", "mlx_lm", "server", "--model", str(model), *common],
            "h2o": ["-m", "mlx_h2o", "serve", "--model", str(model), *common,
                    *shlex.split(args.h2o_args)]}
    print(f"config: model={model.name} mix={args.mix} requests={args.requests} "
          f"warmup={args.warmup} side_by_side={args.side_by_side} "
          f"seed={args.seed} server_args='{args.server_args}' h2o_args='{args.h2o_args}' "
          f"mlx={mx.__version__} mlx_lm={mlx_lm.__version__} "
          f"python={platform.python_version()} cpus={os.cpu_count()}", flush=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="serve_memory_") as tmp:
        def measure(name):
            series = run_server(name, argv[name], requests, args, Path(tmp) / f"{name}.log")
            results[name] = {k: summary(v, args.warmup) for k, v in series.items()}

        if args.side_by_side:
            # Daemons: an interrupted run exits, and its servers die with their threads.
            threads = [threading.Thread(target=measure, args=(n,), daemon=True)
                       for n in args.servers]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:
            for name in args.servers:
                measure(name)
        if len(results) < len(args.servers):
            raise SystemExit("a server failed: see the lines above")
    print_table(results)
    print(json.dumps({"config": vars(args), "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
                      "results": results}))


if __name__ == "__main__":
    main()

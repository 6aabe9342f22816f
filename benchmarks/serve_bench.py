"""Serving benchmark: stock mlx_lm.server (KVCache) vs mlx-h2o serve at KV budgets.

    python benchmarks/serve_bench.py [--clients 4] [--prompt-tokens 1024] [--max-tokens 64]
        [--budgets 256 1024] [--rounds 3] [--interleave] [--out FILE]
        [--model PATH | --random qwen3-8b [--random-bits 4]]
    python benchmarks/serve_bench.py --capacity --prompt-tokens 16384 [--max-clients 64]
        [--bisect] ...

Each server (stock, then one mlx-h2o server a ``--budgets`` value) starts once
on 127.0.0.1, answers one untimed warm-up load of the trial's exact shapes
(``--clients`` requests of ``--prompt-tokens`` tokens generating
``--max-tokens``: MLX compiles kernels on the first use of a shape, which a
short request does not reach), then ``--rounds`` (>= 3) timed loads, and
stops. A load sends its requests at once (streamed /v1/completions, a thread
each; shuffled prose, no two prompts sharing a first token, the same prompts
for every server; greedy, end-of-sequence tokens banned through
``logit_bias``). Every server gets ``--prompt-cache-size 0`` (``--server-args``
may override it): no prompt shares a prefix, so kept caches would only carry
memory from one round into the next. ``--interleave`` restarts every server
for each round instead (warmed again), the order rotating: for machines whose
load drifts, at twice the loads. Ratios to stock are medians over rounds of
ratios paired by round. A server that dies, or a load not answered (every
request streams ``--max-tokens`` tokens within ``--timeout``), is recorded
with the load and the server's error, and the other servers go on.

``--capacity``: the most clients of ``--prompt-tokens`` each server answers:
loads of 1, 2, 4, ... clients (from ``--min-clients``) up to ``--max-clients``,
then with ``--bisect`` halving the gap between the last load answered and the
first failed. ``--no-stock`` leaves stock out (a search split over runs). A server
is kept while it answers and restarted after a failure; loads are not warmed
(the question is whether it answers, not how fast).

Measured a load (serve_load.measure): aggregate generated tok/s (prefill
included), time to first streamed token (median, max), decode tok/s (each
request's tokens after its first over its decode time, summed), KV bytes a
request holds (``usage.h2o``), the server's peak RSS (/proc VmHWM: since the
load began, and over its life) and, where nvidia-smi exists, the most GPU
memory used during the load above what was used before the server started.
Without --model both serve the packaged SmolLM2; ``--random NAME`` builds a
random-weight model with NAME's shapes (mlx_h2o.eval.bench.RANDOM_CONFIGS)
with ``--tokenizer``'s files (``--save-random DIR`` builds it into DIR and
exits; later runs serve it with ``--model DIR``). Prints a config header, a
key=value line per load, the markdown table under the command that made it,
and a final JSON line; ``--out FILE`` writes the markdown and the JSON too.
Every server started is stopped, on errors, Ctrl-C and SIGTERM too.
"""

import argparse
import json
import os
import platform
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

from serve_load import LoadFailed, Served, unwind_on_sigterm
from serve_model import make_prompts, model_info, random_args, resolve, save_random_model
from serve_report import capacity_table, rounds_table, search_capacity, summarise

OPENBLAS_ENV = "LD_PRELOAD"  # shown in the command: it makes CPU matmuls 30x faster


def fmt(v):
    return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def failure(config, clients, prompt_tokens, at, e: LoadFailed):
    print(f"failure config={config['name']} clients={clients} at='{at}' kind='{e.kind}' "
          f"error='{e.error}'", flush=True)
    return {"config": config["name"], "budget": config["budget"], "clients": clients,
            "prompt_tokens": prompt_tokens, "at": "start" if e.kind == "did not start" else at,
            "kind": e.kind, "error": e.error}


def serve_rounds(config, loads, args, bias, log, records):
    """Start ``config``'s server, answer ``loads`` [(round or "warm-up", prompts)] in
    order, stop it. Timed rounds go to ``records``; returns the failure, or None."""
    at = "start"
    try:
        with Served(config["name"], config["argv"], log, args.start_timeout) as served:
            for at, prompts in loads:
                rec = served.load(prompts, args.max_tokens, bias, args.timeout)
                rec = {"round": at, "config": config["name"], "budget": config["budget"],
                       "load1": round(os.getloadavg()[0], 1), **rec}
                print(" ".join(f"{k}={fmt(v)}" for k, v in rec.items() if k != "h2o"),
                      flush=True)
                if at != "warm-up":
                    records.append(rec)
    except Exception as e:  # noqa: BLE001 (recorded; the other servers go on)
        where = at if at in ("start", "warm-up") else f"round {at}"
        return failure(config, args.clients, args.prompt_tokens, where, as_failure(e))
    return None


def as_failure(e: Exception) -> LoadFailed:
    return e if isinstance(e, LoadFailed) else LoadFailed("failed", repr(e))


def run_rounds(args, configs, tok, bias, logs):
    """Every config warmed, then its rounds; (timed records, failures)."""
    n, c = args.rounds + 1, args.clients
    flat = make_prompts(tok, [args.prompt_tokens] * (c * n), seed=0)
    warm, *rounds = [flat[i * c:(i + 1) * c] for i in range(n)]
    records, failures, dead = [], [], set()
    if not args.interleave:
        for cfg in configs:
            loads = [("warm-up", warm), *enumerate(rounds)]
            f = serve_rounds(cfg, loads, args, bias, logs / f"{cfg['name']}.log", records)
            failures += [f] if f else []
        return records, failures
    for r, prompts in enumerate(rounds):
        for cfg in configs[r % len(configs):] + configs[:r % len(configs)]:
            if cfg["name"] in dead:  # it failed this load already
                continue
            log = logs / f"round{r}_{cfg['name']}.log"
            f = serve_rounds(cfg, [("warm-up", warm), (r, prompts)], args, bias, log, records)
            if f:
                failures.append(f)
                dead.add(cfg["name"])
    return records, failures


def capacity_of(cfg, args, tok, bias, logs):
    """search_capacity on ``cfg``'s server, kept while it answers, restarted after a failure."""
    served, loads = None, []

    def answers(n):
        nonlocal served
        prompts = make_prompts(tok, [args.prompt_tokens] * n, seed=n)
        try:
            if served is None:
                served = Served(cfg["name"], cfg["argv"], logs / f"{cfg['name']}_{n}.log",
                                args.start_timeout)
            rec = served.load(prompts, args.max_tokens, bias, args.timeout)
        except Exception as e:  # noqa: BLE001 (recorded; a fresh server takes the next load)
            e = as_failure(e)
            if served is not None:
                served.close()
                served = None
            loads.append({"clients": n, "ok": False, "kind": e.kind, "error": e.error})
            print(f"capacity config={cfg['name']} clients={n} answered=no kind='{e.kind}' "
                  f"error='{e.error}'", flush=True)
            return False
        loads.append({"clients": n, "ok": True, **{k: v for k, v in rec.items() if k != "h2o"}})
        print(f"capacity config={cfg['name']} clients={n} answered=yes " + " ".join(
            f"{k}={fmt(v)}" for k, v in rec.items() if k != "h2o"), flush=True)
        return True

    try:
        clients, failed_at, _ = search_capacity(answers, args.max_clients, args.bisect,
                                                args.min_clients)
    finally:
        if served is not None:
            served.close()
    return {"budget": cfg["budget"], "clients": clients, "failed_at": failed_at, "loads": loads}


def server_configs(args, model: Path):
    h2o_model = [] if args.model is None and args.random is None else ["--model", str(model)]
    common = ["--prompt-cache-size", "0", *shlex.split(args.server_args)]
    configs = [] if args.no_stock else [{"name": "stock", "budget": 0, "argv": [
        "-m", "mlx_lm", "server", "--model", str(model), *common]}]
    for b in args.budgets:
        configs.append({"name": f"h2o-{b}", "budget": b, "argv": [
            "-m", "mlx_h2o", "serve", *h2o_model, "--max-kv-size", str(b), *common,
            *shlex.split(args.h2o_args)]})
    return configs


def command_line():
    """The command that made this run, as it can be typed again."""
    env = os.environ.get(OPENBLAS_ENV)
    return (f"{OPENBLAS_ENV}={env} " if env else "") + "python " + shlex.join(sys.argv)


def setup_arg_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=4, help="concurrent requests a load")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated a request")
    p.add_argument("--budgets", type=int, nargs="*", default=[256, 1024],
                   help="--max-kv-size of each mlx-h2o server")
    p.add_argument("--rounds", type=int, default=3, help="timed loads a server (>= 3)")
    p.add_argument("--interleave", action="store_true",
                   help="restart (and warm) every server for each round, rotating their order")
    p.add_argument("--capacity", action="store_true",
                   help="find the most --prompt-tokens clients each server answers")
    p.add_argument("--min-clients", type=int, default=1, help="--capacity's first load")
    p.add_argument("--max-clients", type=int, default=64, help="--capacity's largest load")
    p.add_argument("--bisect", action="store_true",
                   help="--capacity: bisect between the last load answered and the first failed")
    p.add_argument("--model", default=None,
                   help="local mlx-lm model folder or packaged name (default: SmolLM2)")
    p.add_argument("--random", default=None, metavar="NAME",
                   help="serve random weights with NAME's shapes, e.g. qwen3-8b")
    p.add_argument("--random-bits", type=int, default=4, choices=(0, 4, 8),
                   help="quantize the random model (0: bfloat16)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="--random's tokenizer files (default: the packaged SmolLM2's)")
    p.add_argument("--save-random", default=None, metavar="DIR",
                   help="build --random's model into DIR and exit (serve it with --model DIR)")
    p.add_argument("--no-stock", action="store_true",
                   help="serve the mlx-h2o servers alone (no ratios; e.g. a capacity search "
                   "split over two runs)")
    p.add_argument("--server-args", default="", help="extra flags for every server")
    p.add_argument("--h2o-args", default="", help="extra flags for the mlx-h2o servers")
    p.add_argument("--timeout", type=float, default=600, help="seconds a request may take")
    p.add_argument("--start-timeout", type=float, default=300, help="seconds to /health")
    p.add_argument("--log-dir", default=None, help="keep the servers' logs here")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="also write the markdown table, its command and the JSON here")
    return p


def check_args(args):
    if args.clients < 1 or not 1 <= args.min_clients <= args.max_clients:
        raise ValueError("--clients must be >= 1 and 1 <= --min-clients <= --max-clients")
    if args.no_stock and not args.budgets:
        raise ValueError("--no-stock without --budgets leaves no server: add --budgets")
    if args.rounds < 3:
        raise ValueError(f"--rounds {args.rounds}: use 3 or more (a median of fewer rounds "
                         "is one round's luck)")
    if args.prompt_tokens < 16 or args.max_tokens < 2:
        raise ValueError("--prompt-tokens must be >= 16 and --max-tokens >= 2")
    if args.model and args.random:
        raise ValueError("--model and --random exclude each other: pass one")
    if args.save_random and not args.random:
        raise ValueError("--save-random DIR needs --random NAME (the shapes to build)")


def main():
    args = setup_arg_parser().parse_args()
    try:
        check_args(args)
    except ValueError as e:
        raise SystemExit(f"serve_bench.py: {e}")
    if args.save_random:
        tokenizer = Path(random_args(args)[-1])
        save_random_model(Path(args.save_random), args.random, args.random_bits, tokenizer)
        return
    unwind_on_sigterm()
    tmp = Path(tempfile.mkdtemp(prefix="serve_bench_"))
    logs = Path(args.log_dir) if args.log_dir else tmp
    logs.mkdir(parents=True, exist_ok=True)
    try:
        run(args, tmp, logs)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def header(args, eos):
    import mlx.core as mx
    import mlx_lm

    name = (f"random {args.random} ({args.random_bits or 16}-bit)" if args.random
            else args.model or "smollm2-135m (packaged)")
    mode = (f"capacity clients={args.min_clients}..{args.max_clients} bisect={args.bisect}"
            if args.capacity
            else f"clients={args.clients} rounds={args.rounds} interleave={args.interleave}")
    return (f"config: model={name} {mode} prompt_tokens={args.prompt_tokens} "
            f"max_tokens={args.max_tokens} budgets={args.budgets} server_args='{args.server_args}'"
            f" h2o_args='{args.h2o_args}' timeout={args.timeout:.0f} banned_eos={eos} "
            f"mlx={mx.__version__} mlx_lm={mlx_lm.__version__} "
            f"python={platform.python_version()} machine={platform.machine()} "
            f"cpus={os.cpu_count()} load={'/'.join(f'{x:.1f}' for x in os.getloadavg())}")


def run(args, tmp: Path, logs: Path):
    model = resolve(args, tmp, __file__)
    tok, eos, layers, kv_heads = model_info(model)
    bias = {str(i): -1e4 for i in eos}  # every request generates --max-tokens
    configs = server_configs(args, model)
    config_line = header(args, eos)
    print(config_line, flush=True)
    for c in configs:
        print(f"server {c['name']}: python {shlex.join(c['argv'])}")
    result = {"config": vars(args), "header": config_line}
    if args.capacity:
        found = {c["name"]: capacity_of(c, args, tok, bias, logs) for c in configs}
        table = capacity_table(found, args.prompt_tokens, args.max_tokens)
        result["capacity"] = found
    else:
        records, failures = run_rounds(args, configs, tok, bias, logs)
        rows = summarise(records, failures, configs, layers, kv_heads)
        table = rounds_table(rows, args.prompt_tokens + args.max_tokens)
        result.update(summary=rows, failures=failures,
                      trials=[{k: v for k, v in r.items() if k != "h2o"} for r in records])
    markdown = "\n".join(["```sh", command_line(), "```", "", config_line, "", *table])
    line = json.dumps(result)
    print(markdown)
    print(line, flush=True)
    if args.out:
        out = Path(args.out)
        part = out.with_name(out.name + ".part")  # atomic: a reader sees all of it or none
        part.write_text(f"{markdown}\n\n```json\n{line}\n```\n")
        os.replace(part, out)


if __name__ == "__main__":
    main()

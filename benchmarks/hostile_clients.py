"""Hostile and malformed clients against stock mlx_lm.server and mlx-h2o serve, side by side.

    python benchmarks/hostile_clients.py [--servers stock h2o] [--model PATH]
        [--h2o-args "..."] [--wait 15]

Each server in turn is started on 127.0.0.1 (a free port) and sent every case
of ``CASES`` as raw bytes over a socket: malformed transport (bad UTF-8, deep
JSON, a Content-Length that lies, headers that never end), each request field
mlx-lm reads out of type or range, requests for other models or files, remote
images (a listener on 127.0.0.1 records whether the server fetched), other
methods and paths, and clients that leave before their answer. Recorded per
case: the HTTP status (or what happened instead) and the seconds to it. After
each case a normal request ("Say hi.", greedy) must get the answer it got at
start; a server that fails it (dead generation thread, corrupted answers) is
restarted before the next case. Prints a config header, a line per case and
server, a table and a final JSON line. Every server started is stopped.
"""

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hostile_cases import (  # noqa: E402
    CASES,
    Context,
    Listener,
    Outcome,
    as_expected,
    normal,
)
from serve_load import Server, unwind_on_sigterm  # noqa: E402
from serve_model import model_info  # noqa: E402

# mlx-h2o serve's limits in this tool: short timeouts, so a case that waits
# for them is quick; a prompt limit a test prompt can pass.
H2O_ARGS = ("--header-timeout 2 --body-timeout 2 --max-prompt-tokens 512 "
            "--max-tokens-limit 512")


# --- running ----------------------------------------------------------------------------------
class Target:
    """One server kind: started (again, after a case broke it) on demand."""

    def __init__(self, name, argv, logs: Path, start_timeout):
        self.name, self.argv, self.logs, self.start_timeout = name, argv, logs, start_timeout
        self.server, self.starts, self.reference = None, 0, None

    def ensure(self, ctx):
        """The running server; a fresh one answers the normal request first (stock
        loads its model then), so no case's time includes a start."""
        if self.server is None:
            self.starts += 1
            self.server = Server(self.argv, self.logs / f"{self.name}_{self.starts}.log")
            self.server.wait_ready(self.start_timeout)
            ctx.port = self.server.port
            answer, _ = normal(ctx)
            if self.reference is None:
                self.reference = answer
        ctx.port = self.server.port
        return self.server

    def stop(self):
        if self.server is not None:
            self.server.stop()
            self.server = None


def run_case(case, target, ctx):
    """(outcome, the normal request afterwards answered as at start)."""
    target.ensure(ctx)
    try:
        out = case.run(ctx)
    except OSError as e:
        out = Outcome(None, 0.0, b"", f"client error {type(e).__name__}")
    answer, _ = normal(ctx)
    healthy = answer is not None and answer == target.reference
    if not healthy or out.note.startswith("no answer"):
        # A dead generation thread, corrupted answers, or (no answer) work that
        # may go on: the next case starts afresh.
        target.stop()
    return out, healthy


def run_target(target, ctx):
    results = {}
    try:
        target.ensure(ctx)
        print(f"server {target.name}: reference answer {target.reference!r}", flush=True)
        for case in CASES:
            out, healthy = run_case(case, target, ctx)
            results[case.name] = {"status": out.status, "seconds": round(out.seconds, 2),
                                  "answer": out.describe(), "next_request_ok": healthy,
                                  "as_expected": as_expected(case, out)}
            print(f"server={target.name} case={case.name!r} answer={out.describe()!r} "
                  f"seconds={out.seconds:.2f} next_request_ok={healthy}", flush=True)
    finally:
        target.stop()
    return results


def print_table(results, names):
    print("| case | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for case in CASES:
        cells = []
        for name in names:
            r = results[name][case.name]
            after = "" if r["next_request_ok"] else "; then broken"
            cells.append(f"{r['answer']}, {r['seconds']:.1f} s{after}")
        print(f"| {case.name} | " + " | ".join(cells) + " |")
    for name in names:
        rs = results[name].values()
        print(f"{name}: {sum(not r['next_request_ok'] for r in rs)} of {len(CASES)} cases left "
              f"the server broken; {sum(r['as_expected'] for r in rs)} answered as mlx-h2o "
              "serve should")


def setup_arg_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--servers", nargs="+", default=["stock", "h2o"], choices=("stock", "h2o"))
    p.add_argument("--model", default=None, help="local mlx-lm model folder "
                   "(default: the packaged SmolLM2)")
    p.add_argument("--h2o-args", default=H2O_ARGS, help="flags for mlx-h2o serve")
    p.add_argument("--server-args", default="--max-tokens 8", help="flags for every server")
    p.add_argument("--wait", type=float, default=15, help="seconds a case waits for an answer")
    p.add_argument("--start-timeout", type=float, default=300, help="seconds to /health")
    return p


def main():
    args = setup_arg_parser().parse_args()
    unwind_on_sigterm()
    import mlx.core as mx
    import mlx_lm

    from mlx_h2o.models import resolve_model

    model = Path(args.model or resolve_model("smollm2-135m"))
    _, eos, _, _ = model_info(model)
    h2o = shlex.split(args.h2o_args)
    limit = int(h2o[h2o.index("--max-prompt-tokens") + 1]) if "--max-prompt-tokens" in h2o \
        else 32768
    common = shlex.split(args.server_args)
    argv = {"stock": ["-m", "mlx_lm", "server", "--model", str(model), *common],
            "h2o": ["-m", "mlx_h2o", "serve", "--model", str(model), *common, *h2o]}
    print(f"config: model={model.name} cases={len(CASES)} wait={args.wait:g} "
          f"server_args='{args.server_args}' h2o_args='{args.h2o_args}' mlx={mx.__version__} "
          f"mlx_lm={mlx_lm.__version__} python={platform.python_version()} "
          f"cpus={os.cpu_count()}", flush=True)
    listener = Listener()
    listener.start()
    results = {}
    with tempfile.TemporaryDirectory(prefix="hostile_clients_") as tmp:
        for name in args.servers:
            ctx = Context(0, model.name, eos, limit, args.wait, listener)
            target = Target(name, argv[name], Path(tmp), args.start_timeout)
            results[name] = run_target(target, ctx)
    listener.sock.close()
    print_table(results, args.servers)
    print(json.dumps({"config": vars(args), "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
                      "results": results}))


if __name__ == "__main__":
    main()

"""serve_bench's pure parts: paired ratios, the summary, the capacity search, the tables.

No servers and no models here: records are dicts, one a timed load (``config``,
``round``, ``agg_tok_s``, ``ttft_med_s``, ...), failures dicts with ``config``,
``clients``, ``prompt_tokens``, ``at`` (where: "start", "warm-up", "round 2"),
``kind`` and ``error``.
"""

import statistics

MB = 1e6
BASE = "stock"  # the config every ratio is taken against


def paired_ratios(records, name, key, base=BASE):
    """``key`` of ``name`` over ``base``'s, one ratio for each round both answered."""
    ref = {r["round"]: r[key] for r in records if r["config"] == base}
    return [r[key] / ref[r["round"]] for r in records
            if r["config"] == name and ref.get(r["round"])]


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def kv_bound(h2o, budget, layers, kv_heads):
    """Bytes a request may hold at ``budget`` tokens a layer: K/V (the per-token
    size from ``kvcache_bytes``, KVCache's for exactly the tokens seen) + 12 a head."""
    token_bytes = h2o["kvcache_bytes"] / (layers * h2o["tokens_seen"])
    return budget * layers * (token_bytes + 12 * kv_heads)


def failure_text(f) -> str:
    """One line: "stock: died at 8 clients x 16,384 tokens (round 1): <error>"."""
    if f["at"] == "start":
        return f"{f['config']}: did not start: {f['error']}"
    return (f"{f['config']}: {f['kind']} at {f['clients']} clients x {f['prompt_tokens']:,} "
            f"tokens ({f['at']}): {f['error']}")


def _peak(rs, key):
    values = [r[key] for r in rs if r.get(key) is not None]
    return max(values) if values else None


def summarise(records, failures, configs, layers, kv_heads):
    """Per config: medians over its rounds, paired medians against stock, worst
    peaks, and the failure that ended its rounds (None when it answered all)."""
    kvcache = [r["kvcache_mb"] for r in records if r.get("kvcache_mb")]
    rows = {}
    for c in configs:
        name = c["name"]
        rs = [r for r in records if r["config"] == name]
        row = {"budget": c["budget"], "rounds": len(rs),
               "pairs": len(paired_ratios(records, name, "agg_tok_s")),
               "agg_tok_s": median(r["agg_tok_s"] for r in rs),
               "agg_vs_stock": median(paired_ratios(records, name, "agg_tok_s")),
               "ttft_med_s": median(r["ttft_med_s"] for r in rs),
               "ttft_vs_stock": median(paired_ratios(records, name, "ttft_med_s")),
               "ttft_max_s": _peak(rs, "ttft_max_s"),
               "decode_tok_s": median(r["decode_tok_s"] for r in rs),
               "decode_vs_stock": median(paired_ratios(records, name, "decode_tok_s")),
               "kv_mb": median(kvcache), "kv_bound_mb": None,
               "serve_peak_rss_mb": _peak(rs, "serve_peak_rss_mb"),
               "peak_rss_mb": _peak(rs, "peak_rss_mb"), "gpu_peak_mb": _peak(rs, "gpu_peak_mb"),
               "failure": next((failure_text(f) for f in failures if f["config"] == name),
                               None)}
        if c["budget"] and rs and rs[0].get("h2o"):
            row["kv_mb"] = max(r["kv_mb"] for r in rs)
            row["kv_bound_mb"] = kv_bound(rs[0]["h2o"], c["budget"], layers, kv_heads) / MB
        rows[name] = row
    return rows


def _num(v, spec=".2f", suffix=""):
    return "-" if v is None else f"{v:{spec}}{suffix}"


def rounds_table(rows, context):
    """The markdown table of a rounds run, then a line per failure and per H2O config."""
    lines = ["| server | KV budget | rounds | aggregate tok/s | vs stock | TTFT median / max (s) "
             "| vs stock | decode tok/s | vs stock | KV a request (MB) "
             "| peak RSS serving / process (MB) | GPU peak (MB) |", "|---" * 12 + "|"]
    for name, r in rows.items():
        budget = "-" if not r["budget"] else f"{r['budget']}" + (
            "" if context > r["budget"] else " (not reached)")
        kv = _num(r["kv_mb"], ".1f") + (
            f" (bound {r['kv_bound_mb']:.1f})" if r["kv_bound_mb"] else "")
        rounds = f"{r['rounds']}" + (" (failed: below)" if r["failure"] else "")
        lines.append(
            f"| {name} | {budget} | {rounds} | {_num(r['agg_tok_s'])} | "
            f"{_x(r['agg_vs_stock'])} | {_num(r['ttft_med_s'])} / {_num(r['ttft_max_s'])} | "
            f"{_x(r['ttft_vs_stock'])} | {_num(r['decode_tok_s'])} | "
            f"{_x(r['decode_vs_stock'])} | {kv} | "
            f"{_num(r['serve_peak_rss_mb'], '.0f')} / {_num(r['peak_rss_mb'], '.0f')} | "
            f"{_num(r['gpu_peak_mb'], '.0f')} |")
    lines.append("")
    lines += [r["failure"] for r in rows.values() if r["failure"]]
    stock = rows.get(BASE)
    lines += [_versus_stock(name, r, stock) for name, r in rows.items()
              if stock and r["budget"] and r["rounds"]]
    return lines


def _x(v):
    return _num(v, ".2f", "x")


def _versus_stock(name, r, stock):
    gpu = (f", GPU peak {_x(r['gpu_peak_mb'] / stock['gpu_peak_mb'])}"
           if stock and r["gpu_peak_mb"] and stock["gpu_peak_mb"] else "")
    bound = ("" if r["kv_bound_mb"] is None else f"; KV a request {r['kv_mb']:.1f} MB <= "
             f"bound {r['kv_bound_mb']:.1f} MB: "
             f"{'yes' if r['kv_mb'] <= r['kv_bound_mb'] else 'no'}")
    return (f"{name} vs stock (medians of {r['pairs']} paired rounds): aggregate "
            f"{_x(r['agg_vs_stock'])}, TTFT {_x(r['ttft_vs_stock'])}, decode "
            f"{_x(r['decode_vs_stock'])}{gpu}{bound}")


def search_capacity(answers, max_clients, bisect=False, min_clients=1):
    """The largest n <= max_clients for which ``answers(n)`` holds, assuming a server
    that answers n clients answers fewer: n doubles from min_clients (1, 2, 4, ...,
    then max_clients itself) until a load fails; with ``bisect``, halves the gap
    between the last success (0 before any) and the first failure. Returns
    (capacity, first failing n or None when every load up to max_clients was
    answered, [(n, answered), ...])."""
    if not 1 <= min_clients <= max_clients:
        raise ValueError(f"clients from {min_clients} to {max_clients}: need "
                         "1 <= min_clients <= max_clients")
    tried, answered, failed, n = [], 0, None, min_clients
    while n is not None:
        ok = bool(answers(n))
        tried.append((n, ok))
        if not ok:
            failed = n
            break
        answered = n
        n = None if n >= max_clients else min(2 * n, max_clients)
    while bisect and failed is not None and failed - answered > 1:
        n = (answered + failed) // 2
        ok = bool(answers(n))
        tried.append((n, ok))
        answered, failed = (n, failed) if ok else (answered, n)
    return answered, failed, tried


def capacity_table(results, prompt_tokens, max_tokens):
    """Markdown: per config, the clients it answered, the loads tried, the first failure.
    ``results``: name -> {"budget", "clients", "failed_at", "loads": [load dicts]}."""
    lines = [f"| server | KV budget | clients answered ({prompt_tokens:,}-token prompts, "
             f"{max_tokens} tokens) | loads tried | why the smallest failing load failed |",
             "|---|---|---|---|---|"]
    for name, c in results.items():
        answered = (f"{c['clients']} ({c['failed_at']} failed)" if c["failed_at"]
                    else f">= {c['clients']} (none failed)")
        tried = ", ".join(f"{x['clients']} {'ok' if x['ok'] else x['kind']}" for x in c["loads"])
        fails = [x for x in c["loads"] if not x["ok"]]
        why = min(fails, key=lambda x: x["clients"]) if fails else None
        why = "-" if why is None else f"{why['clients']} clients: {why['kind']}: " + why[
            "error"].replace("|", "/")  # a cell of the table
        budget = "-" if not c["budget"] else str(c["budget"])
        lines.append(f"| {name} | {budget} | {answered} | {tried} | {why} |")
    stock = results.get(BASE)
    lines.append("")
    for name, c in results.items():
        if name == BASE or not stock or not stock["clients"]:
            continue
        notes = [] if c["failed_at"] else [f"{name} failed no load: it may answer more"]
        if not stock["failed_at"]:
            notes.append("stock failed no load: it may answer more")
        lines.append(f"{name} answers {c['clients'] / stock['clients']:.1f}x stock's clients "
                     f"({c['clients']} vs {stock['clients']})" + "".join(f"; {n}" for n in notes))
    return lines

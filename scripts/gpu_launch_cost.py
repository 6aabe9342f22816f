"""What one custom-kernel launch costs MLX's host side, by its shape.

Decode of an 8B model is host bound on the lent H100 (docs/GPU.md): every op
costs build (Python + graph) and dispatch (eval_gpu + CUDA graph node) time.
This probe times chains of ``--layers`` launches of a copy kernel while varying
one thing at a time: number of inputs, number of outputs, output bytes, source
length, ensure_row_contiguous; MLX's put_along_axis and slice update next to
them. Prints ms per chain (build, dispatch) and a final JSON line.

    python3 scripts/gpu_launch_cost.py [--layers 36] [--reps 40]
"""

import argparse
import json
import statistics
import time

import mlx.core as mx

_KERNELS = {}


def copy_kernel(n_in: int, n_out: int, pad: int, contiguous: bool):
    """out_j[i] = in_0[i] for i < the first input's size (other inputs only bound)."""
    key = (n_in, n_out, pad, contiguous)
    if key not in _KERNELS:
        body = "".join(f"    out{j}[i] = in0[i % in0_size];\n" for j in range(n_out))
        src = ("// " + "x" * pad + "\n" if pad else "") + (
            "unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
            "if (i < n_out_elems) {\n" + body + "}\n")
        name = f"probe_copy_{n_in}_{n_out}_{pad}_{int(contiguous)}"
        _KERNELS[key] = mx.fast.cuda_kernel(
            name=name, input_names=[f"in{i}" for i in range(n_in)],
            output_names=[f"out{j}" for j in range(n_out)], source=src,
            ensure_row_contiguous=contiguous)
    return _KERNELS[key]


def launch(kernel, inputs, out_elems: int, n_out: int, dtype):
    return kernel(
        inputs=inputs, output_shapes=[(out_elems,)] * n_out, output_dtypes=[dtype] * n_out,
        grid=(out_elems, 1, 1), threadgroup=(256, 1, 1),
        template=[("in0_size", inputs[0].size), ("n_out_elems", out_elems)])


def chain_time(step, layers: int, reps: int):
    """Median build and dispatch ms of ``layers`` calls of ``step(j)``."""
    builds, disps = [], []
    for r in range(reps):
        mx.synchronize()
        t0 = time.perf_counter()
        outs = [step(j) for j in range(layers)]
        t1 = time.perf_counter()
        mx.async_eval(outs)
        t2 = time.perf_counter()
        mx.synchronize()
        builds.append(t1 - t0)
        disps.append(t2 - t1)
    skip = min(3, reps - 1)
    return (statistics.median(builds[skip:]) * 1e3, statistics.median(disps[skip:]) * 1e3)


def variants(elems: int):
    """name -> (n_in, n_out, out_elems, pad, contiguous)."""
    base = (3, 1, elems, 0, True)
    v = {"in3_out1": base}
    for n_in in (1, 6, 9, 17):
        v[f"in{n_in}_out1"] = (n_in, 1, elems, 0, True)
    for n_out in (2, 4, 8):
        v[f"in3_out{n_out}"] = (3, n_out, elems, 0, True)
    v["in9_out8"] = (9, 8, elems, 0, True)
    v["in6_out4"] = (6, 4, elems, 0, True)
    v["in6_out5"] = (6, 5, elems, 0, True)
    v["in3_out1_small"] = (3, 1, 256, 0, True)
    v["in3_out1_big"] = (3, 1, elems * 8, 0, True)
    v["in3_out1_src16k"] = (3, 1, elems, 16000, True)
    v["in9_out8_noncontig_flag"] = (9, 8, elems, 0, False)
    return v


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--slots", type=int, default=256, help="cache slots per layer")
    args = ap.parse_args()
    if not mx.cuda.is_available():
        raise SystemExit("this probe needs MLX's CUDA backend (mx.fast.cuda_kernel)")
    B, Hk, D, dt = 1, 8, 128, mx.bfloat16
    elems = B * Hk * args.slots * D
    arrays = [mx.random.normal((elems,)).astype(dt) for _ in range(17)]
    mx.eval(arrays)
    res = {}
    for name, (n_in, n_out, out_elems, pad, contig) in variants(elems).items():
        k = copy_kernel(n_in, n_out, pad, contig)
        step = (lambda j, k=k, n_in=n_in, n_out=n_out, oe=out_elems:
                launch(k, arrays[:n_in], oe, n_out, dt))
        chain_time(step, 2, 2)  # compile outside the timing
        res[name] = chain_time(step, args.layers, args.reps)
    cache = [mx.random.normal((B, Hk, args.slots, D)).astype(dt) for _ in range(args.layers)]
    new = mx.random.normal((B, Hk, 1, D)).astype(dt)
    idx = mx.broadcast_to(mx.random.randint(0, args.slots, (B, Hk, 1, 1)), (B, Hk, 1, D))
    mx.eval(cache, new, idx)

    def scatter(j):
        cache[j] = mx.put_along_axis(cache[j], idx, new, axis=2)
        return cache[j]

    def slice_update(j):
        cache[j][..., 5:6, :] = new
        return cache[j]

    res["put_along_axis"] = chain_time(scatter, args.layers, args.reps)
    res["slice_update"] = chain_time(slice_update, args.layers, args.reps)
    base_b, base_d = res["in3_out1"]
    print(f"mlx {mx.__version__}; {args.layers} launches per chain, {args.reps} reps; "
          f"ms per chain (build, dispatch), delta vs in3_out1 per launch in us")
    for name, (b, d) in res.items():
        per = (b + d - base_b - base_d) / args.layers * 1e3
        print(f"{name:>26}: build {b:6.3f} dispatch {d:6.3f}  delta/launch {per:+6.2f} us")
    print(json.dumps({k: {"build_ms": round(b, 4), "dispatch_ms": round(d, 4)}
                      for k, (b, d) in res.items()}))


if __name__ == "__main__":
    main()

"""Assemble kernel sources and build the kernel objects once per flag set."""

import hashlib
from functools import lru_cache
from string import Template
from typing import List, Optional, Tuple

import mlx.core as mx

from ..scores import SCORES, score_mode
from . import cubin
from . import source as src
from . import source_mma

MASK_KINDS = ("none", "causal", "bool", "add")
# Score modes by the kernels' MODE constant (an entry's kernel_id; Swift's
# KernelConstants.scoreModes indexes the same way).
SCORE_MODES = tuple(m.name for m in sorted(SCORES.values(), key=lambda m: m.kernel_id))


def mode_id(mode: str) -> int:
    """The kernels' MODE constant of score mode ``mode`` (ValueError if unknown)."""
    return score_mode(mode).kernel_id


# Entries of a Metal kernel's buffer argument table: MLX's metal_kernel binds
# each input, each of its _shape / _strides / _ndim the body names, and each
# output to one (mlx/backend/metal/custom_kernel.cpp).
METAL_BUFFERS = 31


@lru_cache(maxsize=1)
def device_backend() -> Optional[str]:
    """'metal', 'cuda' or None: the GPU backend of this MLX build, the one the
    kernel factories build for."""
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return None


def _prelude(backend: str) -> Tuple[str, str]:
    if backend == "cuda":
        return src.CUDA_HEADER, src.CUDA_IDS
    if backend == "metal":
        return src.METAL_HEADER, src.METAL_IDS
    raise ValueError(f"unknown backend {backend!r}")


def _mask_apply(mask: str, fused: bool, rows: bool = False) -> str:
    code = {
        "none": "",
        "causal": src.MASK_CAUSAL,
        "bool": src.MASK_BOOL,
        "add": src.MASK_ADD,
    }[mask]
    lines = [code] if code else []
    if fused:
        lines.append(src.MASK_ROWS if rows else src.MASK_WINDOW)
    return "\n".join(" " * 14 + line for line in lines)


def pass1_names(mask: str, sinks: bool, split: bool, fused: bool, rows: bool = False):
    """Input and output names of pass 1 for these flags (``rows`` names the
    same buffers: its parameters are a longer ``prm_i``)."""
    inputs = ["q", "k", "v", "prm_f"]
    inputs += ["mask"] if mask in ("bool", "add") else []
    inputs += ["sinks"] if (sinks and not split) else []  # pass 2 adds them
    if fused:
        inputs += ["pos_in", "slot", "prm_i"]
        inputs += [] if split else ["score_in", "count_in", "pin"]
    if split:
        return inputs, ["logits", "part_o", "part_ml"]
    outputs = ["out", "logits", "lse"]
    outputs += ["pos_out", "score_out", "count_out", "victim"] if fused else []
    return inputs, outputs


def param_markers(rows: bool, block_row: str) -> dict:
    """The fused step's $PRM / $FLAGS: the launch's prm_i, or (``rows``: rows
    at different fill levels) the 8 of the row that ``block_row`` names."""
    if not rows:
        return {"PRM": "prm_i", "FLAGS": "0"}
    prm = f"(prm_i + ({block_row}) * 8)"
    return {"PRM": prm, "FLAGS": f"{prm}[6]"}


def fold_text(nv: str, ns: str, vw: str, rows: bool = False) -> str:
    """FOLD for one (sequence or row, KV head) block: blk_x = b * HK + hk."""
    return Template(src.FOLD).substitute(NV=nv, NS=ns, VW=vw, **param_markers(rows, "blk_x / HK"))


def _victim_width(rows: bool) -> str:
    # A sequence's victim is repeated along D: it indexes the next token's K/V
    # writes as is. Rows take theirs as a (B, Hk, 1) slot index.
    return "1" if rows else "D"


def pass1_source(backend: str, mask: str, sinks: bool, split: bool, fused: bool,
                 rows: bool = False):
    """(header, body) of pass 1; ``rows``: the fused step over rows at
    different fill levels (per-row parameters)."""
    if mask not in MASK_KINDS:
        raise ValueError(f"unknown mask kind {mask!r}")
    header, ids = _prelude(backend)
    tail = ""
    if fused and not split:
        tail = src.FOLD_PASS1_LSE + fold_text("N", "NS", _victim_width(rows), rows)
    body = Template(src.PASS1).substitute(
        IDS=ids,
        MASK_SETUP=src.MASK_SETUP if mask in ("bool", "add") else "",
        FUSED_SETUP=(Template(src.FUSED_SETUP).substitute(param_markers(rows, "b")) if fused
                     else ""),
        FUSED_KPOS=(" " * 10 + src.FUSED_KPOS) if fused else "",
        MASK_APPLY=_mask_apply(mask, fused, rows),
        SINK_INIT=src.SINK_INIT_PASS1 if (sinks and not split) else "",
        WRITE_ROW=src.WRITE_PARTIAL if split else src.WRITE_FINAL,
        RANGE=Template(src.PASS1_RANGE).substitute(NVALID="prm_i[5]" if fused else "NS"),
        KV_VEC=src.KV_VEC, TAIL=tail,
    )
    return header, body


MMA_MASK_KINDS = ("none", "causal")


def pass1mma_names(mask: str):
    """Input and output names of the tensor-core pass 1 (split, no sinks)."""
    return pass1_names(mask, False, True, False)


def pass1mma_source(backend: str, mask: str):
    """(header, body) of the tensor-core pass 1 (source_mma.py; CUDA only)."""
    if backend != "cuda":
        raise ValueError(f"the tensor-core pass 1 is CUDA only, not {backend!r}")
    if mask not in MMA_MASK_KINDS:
        raise ValueError(f"the tensor-core pass 1 takes masks {MMA_MASK_KINDS}, not {mask!r}")
    header, ids = _prelude(backend)
    body = Template(source_mma.PASS1_MMA).substitute(
        IDS=ids, RANGE=Template(src.PASS1_RANGE).substitute(NVALID="NS"), KV_VEC=src.KV_VEC,
        MASK_APPLY=_mask_apply(mask, False))
    return header + source_mma.MMA_HEADER, body


def pass2_names(sinks: bool, fused: bool, rows: bool = False):
    inputs = ["part_o", "part_ml"] + (["sinks"] if sinks else [])
    outputs = ["out", "lse"]
    if fused:
        inputs += ["logits", "pos_in", "score_in", "count_in", "slot", "prm_i"]
        inputs += ["prm_f", "pin"]
        outputs += ["pos_out", "score_out", "count_out", "victim"]
    return inputs, outputs


def pass2_source(backend: str, sinks: bool, fused: bool, rows: bool = False):
    header, ids = _prelude(backend)
    body = Template(src.PASS2).substitute(
        IDS=ids,
        FUSED_ROWS=f"  constexpr bool FUSED_ROWS = {'true' if fused else 'false'};",
        SINK_MAX=src.SINK_MAX_PASS2 if sinks else "",
        SINK_SUM=src.SINK_SUM_PASS2 if sinks else "",
        TAIL=fold_text("prm_i[5]", "logits_shape[3]", _victim_width(rows), rows) if fused else "",
    )
    return header, body


def fold_names():
    inputs = ["logits", "lse", "pos_in", "score_in", "count_in", "slot", "prm_i", "prm_f", "pin"]
    return inputs, ["pos_out", "score_out", "count_out", "victim"]


def fold_source(backend: str):
    """(header, body) of the fold-only kernel (score fold + next victim)."""
    header, ids = _prelude(backend)
    tail = fold_text("prm_i[5]", "logits_shape[3]", "D")
    return header, Template(src.FOLD_ONLY).substitute(IDS=ids, TAIL=tail)


def _digest(*parts: str) -> str:
    return hashlib.sha1("\0".join(parts).encode()).hexdigest()[:10]


def _kernel(backend: str, name: str, names, header: str, body: str, contiguous=False):
    inputs, outputs = names
    # The source hash is in the name: MLX caches compiled kernels by name.
    full = f"{name}_{_digest(header, body)}"
    make = mx.fast.cuda_kernel if backend == "cuda" else mx.fast.metal_kernel
    return make(
        name=full, input_names=inputs, output_names=outputs, source=body,
        header=header, ensure_row_contiguous=contiguous,
    )


def _precompiled(backend: str, name: str, names, header: str, body: str, fallback):
    """The kernel built once per machine (kernels/cubin.py; MLX builds its own
    in every process, ~1.5 s a kernel at first use) for calls whose inputs are
    row-contiguous, ``fallback`` if its build fails; None where cubins are not
    built (not CUDA, no NVRTC)."""
    if backend != "cuda" or not cubin.available():
        return None
    return cubin.PrecompiledKernel(name, *names, header, body, fallback=fallback)


def _built_once(backend: str, name: str, names, header: str, body: str):
    """A kernel whose inputs are made row-contiguous: ``_precompiled`` where it
    builds, else as ``_kernel`` builds it."""
    made = _kernel(backend, name, names, header, body, contiguous=True)
    return _precompiled(backend, name, names, header, body, made) or made


@lru_cache(maxsize=None)
def _make_pass1_kernel(mask: str, sinks: bool, split: bool, fused: bool, rows: bool = False):
    """Pass-1 kernel for these flags, or None without a GPU backend. Built for
    ``device_backend()``: the first-use check itself runs these."""
    backend = device_backend()
    if backend is None:
        return None
    return _kernel(backend, _pass1_name(mask, sinks, split, fused, rows),
                   pass1_names(mask, sinks, split, fused),
                   *pass1_source(backend, mask, sinks, split, fused, rows))


@lru_cache(maxsize=None)
def _make_pass1_mma_kernel(mask: str):
    """The tensor-core pass 1 (split, float16 / bfloat16) on CUDA, else None."""
    if device_backend() != "cuda":
        return None
    return _kernel("cuda", f"h2o_attn1mma_{mask}", pass1mma_names(mask),
                   *pass1mma_source("cuda", mask))


def _pass1_name(mask: str, sinks: bool, split: bool, fused: bool, rows: bool = False) -> str:
    tag = "r" if rows else ""
    return f"h2o_attn1{tag}_{mask}_{int(sinks and not split)}{int(split)}{int(fused)}"


@lru_cache(maxsize=None)
def _make_pass2_kernel(sinks: bool, fused: bool, rows: bool = False):
    """Pass-2 (split merge, optional H2O fold) kernel, or None without a GPU.
    Built for ``device_backend()``, as pass 1."""
    backend = device_backend()
    if backend is None:
        return None
    return _kernel(backend, _pass2_name(sinks, fused, rows), pass2_names(sinks, fused),
                   *pass2_source(backend, sinks, fused, rows))


def _pass2_name(sinks: bool, fused: bool, rows: bool = False) -> str:
    return f"h2o_attn2{'r' if rows else ''}_{int(sinks)}{int(fused)}"


@lru_cache(maxsize=None)
def _make_fold_kernel(backend: Optional[str]):
    """Fold-only kernel for ``backend`` (the caller's ``gpu_backend()``), or
    None without one. Its logits are indexed flat, so inputs are made
    row-contiguous (a no-op for kernel outputs)."""
    if backend is None:
        return None
    return _built_once(backend, "h2o_fold", fold_names(), *fold_source(backend))


@lru_cache(maxsize=None)
def _make_pass1_precompiled(mask: str, sinks: bool, split: bool, fused: bool,
                            rows: bool = False):
    """``_make_pass1_kernel``'s kernel as ``_precompiled``, for calls whose
    inputs are all row-contiguous, such as a cache's whole buffers (MLX's
    build reads strided views in place)."""
    return _precompiled(device_backend(), _pass1_name(mask, sinks, split, fused, rows),
                        pass1_names(mask, sinks, split, fused),
                        *pass1_source("cuda", mask, sinks, split, fused, rows),
                        _make_pass1_kernel(mask, sinks, split, fused, rows))


@lru_cache(maxsize=None)
def _make_pass2_precompiled(sinks: bool, fused: bool, rows: bool = False):
    """``_make_pass2_kernel``'s kernel as ``_precompiled``, as pass 1's."""
    return _precompiled(device_backend(), _pass2_name(sinks, fused, rows),
                        pass2_names(sinks, fused), *pass2_source("cuda", sinks, fused, rows),
                        _make_pass2_kernel(sinks, fused, rows))


def all_sources(backend: str) -> List[Tuple[str, str, str]]:
    """(label, header, body) of every kernel variant, for compile checks."""
    out = []
    for mask in MASK_KINDS:
        for sinks in (False, True):
            for split in (False, True):
                for fused in (False, True):
                    label = f"pass1 mask={mask} sinks={sinks} split={split} fused={fused}"
                    out.append((label, *pass1_source(backend, mask, sinks, split, fused)))
    for sinks in (False, True):
        for fused in (False, True):
            out.append((f"pass2 sinks={sinks} fused={fused}", *pass2_source(backend, sinks, fused)))
    for sinks in (False, True):  # the fused step over rows at different fill levels
        for split in (False, True):
            label = f"pass1 mask=none sinks={sinks} split={split} fused=True rows=True"
            out.append((label, *pass1_source(backend, "none", sinks, split, True, True)))
        out.append((f"pass2 sinks={sinks} fused=True rows=True",
                    *pass2_source(backend, sinks, True, True)))
    out.append(("fold", *fold_source(backend)))
    if backend == "cuda":
        out += [(f"pass1mma mask={m}", *pass1mma_source(backend, m)) for m in MMA_MASK_KINDS]
    for n in (1, 3):
        for q in (False, True):
            out.append((f"group layers={n} quantized={q}", *group_source(backend, n, q)))
    return out


def group_names(n_layers: int, quantized: bool = False):
    """Input and output names of the group fold over ``n_layers`` layers."""
    qs = [f"q{i}" for i in range(n_layers)]
    ks = [f"k{i}" for i in range(n_layers)]  # dense K, or packed K/V (``quantized``)
    inputs = [*qs, *ks, "lay_i", "lay_f", "pos_in",
              "score_in", "count_in", "slot", "pin"]
    return inputs, ["pos_out", "score_out", "count_out", "victim", "logits", "lay_out"]


def group_source(backend: str, n_layers: int, quantized: bool = False):
    """(header, body) of the group fold (kernels/group_fold.py) over dense K
    buffers or packed quantized K/V (kernels/packed.py; constants BITS, GS)."""
    header, ids = _prelude(backend)

    def select(name):  # layer == 0 ? name0 : layer == 1 ? name1 : ... : name{n-1}
        head = "".join(f"layer == {i} ? {name}{i} : " for i in range(n_layers - 1))
        return f"{head}{name}{n_layers - 1}"

    if quantized:
        ksetup = Template(src.GROUP_K_QUANT).substitute(KSELECT=select("k"))
        kload = src.GROUP_LOAD_QUANT
    else:
        ksetup = Template(src.GROUP_K_DENSE).substitute(KSELECT=select("k"))
        kload = src.GROUP_LOAD_DENSE
    body = Template(src.GROUP_FOLD).substitute(
        IDS=ids, KSETUP=ksetup.strip("\n"), KLOAD=kload.strip("\n"), QSELECT=select("q"),
        FOLD=fold_text("prm_i[5]", "pos_in_shape[2]", "VD"),
    )
    return header, body


@lru_cache(maxsize=None)
def _make_group_kernel(backend: Optional[str], n_layers: int, quantized: bool = False):
    """Group-fold kernel over ``n_layers`` layers for ``backend`` (the caller's
    ``gpu_backend()``), or None without one. Inputs are made row-contiguous:
    K buffers and queries are indexed flat."""
    if backend is None:
        return None
    # Precompiled: no ~2 s build at a CUDA process's first evicting step.
    return _built_once(backend, f"h2o_group{'q' if quantized else ''}{n_layers}",
                       group_names(n_layers, quantized),
                       *group_source(backend, n_layers, quantized))

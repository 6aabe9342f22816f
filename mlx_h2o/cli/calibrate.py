"""`mlx-h2o calibrate`: measure a model's layer profile (per-layer budget weights).

Example (how the shipped profiles were made; any mlx-lm model works):
    mlx-h2o calibrate --model smollm2-135m --out mlx_h2o/profiles/smollm2-135m.json
Then `mlx-h2o generate --h2o-layer-budget FILE`, `make_h2o_cache(...,
layer_budget=FILE)` or the eval strategy `h2o-heavy:layer_budget=FILE`.
"""

import shlex
import time
from pathlib import Path

from ..eval.calibrate import CALIBRATION, DEFAULT_STATISTIC, WEIGHTS
from ..eval.common import load_any
from ..eval.results import slug
from .common import add_model_arg, check_model_arg, check_out_file, command_parser, fail


def setup_arg_parser():
    p = command_parser("calibrate", __doc__)
    add_model_arg(p)
    p.add_argument("--corpus", default=CALIBRATION["corpus"],
                   help="calibration text: a corpus name (austen, python-docs, ...), "
                   "hf:<dataset> or the path of a text file or folder "
                   f"({CALIBRATION['num_samples']} windows of {CALIBRATION['seq_len']} "
                   f"tokens, seed {CALIBRATION['seed']})")
    p.add_argument("--statistic", choices=sorted(WEIGHTS), default=DEFAULT_STATISTIC,
                   help="per-layer weight")
    p.add_argument("--out", default=None,
                   help="profile file to write (default: <model>.layer-profile.json)")
    return p


def main(argv=None) -> int:
    argv = [] if argv is None else list(argv)
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    out = Path(args.out or f"{slug(Path(args.model).name)}.layer-profile.json")
    check_out_file(parser, "--out", out)
    check_model_arg(parser, args.model)
    from ..eval.calibrate import calibration_spec, make_profile
    from ..eval.corpora import CorpusNotFoundError, check_corpus
    from ..profiles import save_profile

    try:
        check_corpus(args.corpus)  # before the model loads
    except (CorpusNotFoundError, ValueError) as e:
        fail(parser, f"--corpus {args.corpus}: {e}")
    tic = time.perf_counter()
    try:
        model, tokenizer = load_any(args.model)
    except (OSError, ValueError) as e:
        fail(parser, f"--model {args.model}: could not load it ({type(e).__name__}: "
             f"{str(e).splitlines()[0] if str(e) else ''})")
    command = "mlx-h2o calibrate " + shlex.join(argv)
    try:
        profile = make_profile(model, tokenizer, args.statistic,
                               calibration_spec(args.corpus), model_label=args.model,
                               command=command)
    except CorpusNotFoundError as e:
        fail(parser, f"--corpus {args.corpus}: {e}")
    save_profile(profile, out)
    print(f"# {command}")
    print(f"weights ({profile.statistic}, {profile.attention_layers} attention layers): "
          + " ".join(f"{w:.3f}" for w in profile.weights))
    print(f"wrote {out} in {time.perf_counter() - tic:.1f}s")
    return 0

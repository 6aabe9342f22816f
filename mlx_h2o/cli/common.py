"""What the commands share: their parsers, one-line user errors, model and data
checks before anything loads, and plots that matplotlib may be missing for."""

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional

from ..eval.results import DEFAULT_ROOT

PLOT_HINT = "pip install 'mlx-h2o[plot]'"


class HelpFormatter(argparse.RawDescriptionHelpFormatter,
                    argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written (its examples), every flag's default (a
    switch's False and an unset None are left out)."""

    def _get_help_string(self, action):
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def command_parser(name: str, doc: str) -> argparse.ArgumentParser:
    """`mlx-h2o <name>`'s parser; ``doc``: the command module's docstring."""
    return argparse.ArgumentParser(prog=f"mlx-h2o {name}", description=doc.strip(),
                                   formatter_class=HelpFormatter)


def add_model_arg(parser: argparse.ArgumentParser) -> None:
    """The evaluation commands' ``--model``: a packaged model or an mlx-lm path."""
    parser.add_argument("--model", default="smollm2-135m",
                        help="packaged model (smollm2-135m, gemma3-270m, "
                        "qwen2.5-coder-0.5b) or an mlx-lm path")


def add_corpus_arg(parser: argparse.ArgumentParser) -> None:
    """The evaluation commands' ``--corpus`` (perplexity, profiles)."""
    parser.add_argument("--corpus", default="austen",
                        help="austen, shakespeare, python-docs, python-src, sharegpt, "
                        "iso-codes, hf:<dataset>, or the path of a text file or of a "
                        "folder of *.txt files")


def add_contexts_arg(parser: argparse.ArgumentParser) -> None:
    """The retrieval commands' ``--contexts``."""
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096],
                        help="prompt lengths in tokens")


def add_prompt_args(parser: argparse.ArgumentParser) -> None:
    """The retrieval commands' ``--strategies`` and ``--prefill-step-size``."""
    parser.add_argument("--strategies", nargs="+",
                        default=["baseline", "rotating", "h2o-heavy"],
                        help="names from mlx_h2o.eval.strategies (name:key=value,...)")
    add_prefill_step_arg(parser)


def add_prefill_step_arg(parser: argparse.ArgumentParser) -> None:
    """mlx-lm's ``--prefill-step-size`` (``--prefill-step``: its old spelling here)."""
    parser.add_argument("--prefill-step-size", type=int, default=2048,
                        help="prompt chunk size in tokens (mlx-lm's default is 2048)")
    add_alias(parser, "--prefill-step", "prefill_step_size", type=int)


def add_max_kv_size_arg(parser: argparse.ArgumentParser, default=(256,)) -> None:
    """The budgets of the bounded strategies: mlx-lm's ``--max-kv-size``
    (``--max-kv``: its old spelling here), one or several."""
    parser.add_argument("--max-kv-size", type=int, nargs="+", default=list(default),
                        metavar="N", help="KV budget in tokens a layer, one or several (a sweep): "
                        "rotating keeps the newest, h2o-* evict by score; under a "
                        "strategy's layer profile (h2o-* on a packaged model) the mean "
                        "over layers")
    add_alias(parser, "--max-kv", "max_kv_size", type=int, nargs="+")


def add_alias(parser: argparse.ArgumentParser, old: str, dest: str, **kwargs) -> None:
    """``old``, an earlier spelling of the flag that sets ``dest``: parsed,
    not shown by --help."""
    parser.add_argument(old, dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                        **kwargs)


def add_output_args(parser: argparse.ArgumentParser) -> None:
    """Where the evaluation commands write, and their progress bars."""
    parser.add_argument("--results-dir", default=DEFAULT_ROOT, help="root of the results")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def fail(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """End the command as argparse does for a bad flag: one line, exit code 2."""
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def check_model_arg(parser, name: Optional[str], flag: str = "--model") -> None:
    """A --model that is neither a packaged model, an existing folder nor a
    Hugging Face repo id ends the command before anything loads."""
    from ..models import PACKAGED_MODELS

    if name is None or name in PACKAGED_MODELS:
        return
    path = Path(name).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        fail(parser, f"{flag} {name}: this folder has no config.json (not an mlx-lm "
             "model folder)")
    if path.exists() or _is_repo_id(name):
        return
    known = ", ".join(sorted(PACKAGED_MODELS))
    fail(parser, f"{flag} {name}: no such folder; use a packaged model ({known}), an "
         "mlx-lm model folder or a Hugging Face repo id (owner/name)")


def _is_repo_id(name: str) -> bool:
    if name.count("/") != 1 or name.startswith((".", "/", "~")):
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
        return True
    except HFValidationError:
        return False


def load_model_or_fail(parser, name: Optional[str], flag: str = "--model", **kwargs):
    """``mlx_h2o.models.load_model``; a model that cannot be found or fetched ends
    the command with one line."""
    from ..models import load_model

    check_model_arg(parser, name, flag)
    try:
        return load_model(name, **kwargs)
    except (OSError, ValueError) as e:
        if type(e).__module__.startswith("huggingface_hub"):
            fail(parser, f"{flag} {name}: not a local folder or packaged model, and the "
                 "Hugging Face Hub has no such repo or cannot be reached "
                 f"({type(e).__name__})")
        first = next((l for l in str(e).splitlines() if l.strip()), "")
        fail(parser, f"{flag} {name}: could not load it ({type(e).__name__}: {first})")


def ensure_corpus_or_fail(parser, name: str, flag: str = "--corpus") -> None:
    """A corpus that cannot be read here ends the command before the model loads,
    with one line saying what to install (``pip``) or pass instead; nothing is
    installed."""
    from ..eval import corpora

    try:
        corpora.check_corpus(name)
    except (corpora.CorpusNotFoundError, ValueError) as e:
        fail(parser, f"{flag} {name}: {e}")


def has_matplotlib(prog: str) -> bool:
    """Whether plots can be drawn; says once, up front, when they cannot."""
    try:
        import matplotlib  # noqa: F401
        return True
    except ImportError:
        pass
    print(f"# {prog}: matplotlib is not installed: results are saved without plots "
          f"({PLOT_HINT} adds them)", file=sys.stderr)
    return False


def save_plot(draw: Callable[..., Path], *args: Any, **kwargs: Any) -> Optional[Path]:
    """``draw(*args, **kwargs)``, its path printed; None without matplotlib."""
    try:
        out = draw(*args, **kwargs)
    except ImportError:
        print(f"# no plot: matplotlib is not installed ({PLOT_HINT})", file=sys.stderr)
        return None
    print(f"# plot {out}")
    return out


def strategies_or_fail(parser, specs) -> list:
    """Parsed ``--strategies``; one calibrated in-process (``layer_budget=invtopk``)
    needs the calibration corpus, one with a profile file a readable profile:
    checked here too."""
    from ..eval.calibrate import CALIBRATION
    from ..eval.strategies import STATISTICS, parse_strategy

    out = []
    for spec in specs:
        try:
            out.append(parse_strategy(spec))
        except (ValueError, TypeError) as e:
            fail(parser, f"--strategies {spec}: {e}")
        if out[-1].layer_budget in STATISTICS:
            ensure_corpus_or_fail(parser, CALIBRATION["corpus"], f"--strategies {spec}: "
                                  "calibration corpus")
        elif out[-1].layer_budget.endswith(".json"):
            from ..profiles import load_profile

            try:
                load_profile(out[-1].layer_budget)
            except ValueError as e:
                fail(parser, f"--strategies {spec}: {e}")
    return out


# --- argument checks, before anything loads ---------------------------------------------


def check_at_least(parser, flag: str, values, least: int) -> None:
    """Each of ``values`` (one number or a list) is >= ``least``."""
    for v in values if isinstance(values, (list, tuple)) else [values]:
        if v < least:
            fail(parser, f"{flag} {v:g}: use a value >= {least}")


def check_depths(parser, depths) -> None:
    for d in depths:
        if not 0 <= d <= 1:
            fail(parser, f"--depths {d:g}: a depth is a fraction of the filler, in [0, 1]")


def check_budgets(parser, strategies, budgets, flag: str = "--max-kv-size") -> None:
    """Every bounded strategy can be made at every budget: ``budgets`` holds
    tokens, or (how the user wrote it, tokens) pairs."""
    for b in budgets:
        label, kv = b if isinstance(b, tuple) else (b, b)
        if kv < 1:
            fail(parser, f"{flag} {label}: a budget is the tokens a layer holds: use 1 or more")
        for st in strategies:
            try:
                st.check_budget(kv)
            except ValueError as e:
                fail(parser, f"{flag} {label}: {e}")


def check_out_file(parser, flag: str, path) -> None:
    """A file to write: its folder must exist."""
    folder = Path(path).expanduser().parent
    if not folder.is_dir():
        fail(parser, f"{flag} {path}: folder {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK):
        fail(parser, f"{flag} {path}: folder {folder} is not writable; write elsewhere")


def load_tokenizer_or_fail(parser, name: Optional[str], flag: str = "--model"):
    """The model's tokenizer alone (a packaged model is prepared, no weights
    are loaded): prompts are built, and checked, before the model loads."""
    from mlx_lm.utils import load_tokenizer

    from ..models import resolve_model

    check_model_arg(parser, name, flag)
    try:
        return load_tokenizer(resolve_model(name))  # a hub repo: its tokenizer files only
    except (OSError, ValueError) as e:
        first = next((l for l in str(e).splitlines() if l.strip()), type(e).__name__)
        fail(parser, f"{flag} {name}: could not load its tokenizer ({first})")

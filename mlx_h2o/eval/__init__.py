"""Evaluation: offline corpora, token windows, passkey prompts, perplexity tools.

Import the submodules directly (``mlx_h2o.eval.corpora``, ...); nothing is
imported here so that loading one tool stays cheap.
"""

"""mlx-h2o: H2O (Heavy-Hitter Oracle) KV-cache eviction for mlx-lm.

Nothing is patched at import: use ``with mlx_h2o.patch():`` (or ``generate``).
"""

from .cache import H2OKVCache, recover_prompt_cache
from .config import SCORE_MODES, H2OConfig
from .integration.factory import make_h2o_cache
from .integration.generate import generate, stream_generate
from .integration.routing import disable, enable, is_enabled, patch
from .integration.stats import cache_stats

__all__ = [
    "H2OConfig",
    "H2OKVCache",
    "SCORE_MODES",
    "cache_stats",
    "disable",
    "enable",
    "generate",
    "is_enabled",
    "make_h2o_cache",
    "patch",
    "recover_prompt_cache",
    "stream_generate",
]
__version__ = "0.1.0"

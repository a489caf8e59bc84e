"""moetrain data pipeline: text sources -> tokenizer -> token shards -> packed data-parallel batches.

Typical use::

    from moetrain.data import DataConfig, prepare_data, TokenLoader, iter_eval_batches

    prep = prepare_data(DataConfig(paths=["corpus/**/*.jsonl"], seq_len=1024))   # cached, process-safe
    loader = TokenLoader(prep.train_path, seq_len=1024, micro_batch_size=8, dp_rank=rank, dp_size=world, seed=0)
    inputs, labels = loader.next_batch()          # int64 (8, 1024) each; labels = inputs shifted by one
    state = loader.state_dict()                   # {"epoch": ..., "position": ..., ...}; load_state_dict(state)

With ``DataConfig()`` (no paths) the built-in corpus - the Python standard library's ``.py`` sources - is used and
a 4096-token byte-level BPE is trained on it. With ``DataConfig(sources=[...])`` (:class:`DataSource`: files,
Hugging Face ``datasets`` folders or hub-cache names, each with a weight) every source gets its own shards and
:func:`train_loader` draws from them by weight (:class:`MixtureLoader`).
"""

from .config import DataConfig, DataSource, parse_source_spec, validate_source
from .corpus import DataError, builtin_corpus_paths, check_sources, iter_documents, resolve_paths, source_kind
from .loader import TokenLoader, count_windows, iter_eval_batches
from .mixture import Loader, MixtureLoader, mixture_counts, mixture_report, mixture_schedule, train_loader
from .prepare import PreparedData, PreparedSource, prepare_data, prepared_data
from .sources import OpenSource, open_source
from .shards import ShardInfo, doc_split, load_tokens, read_meta, token_dtype, write_shards
from .tokenizer import EOS_CANDIDATES, Tokenizer, load_tokenizer, train_bpe

__all__ = [
    "DataConfig",
    "DataError",
    "DataSource",
    "EOS_CANDIDATES",
    "Loader",
    "MixtureLoader",
    "OpenSource",
    "PreparedData",
    "PreparedSource",
    "ShardInfo",
    "TokenLoader",
    "Tokenizer",
    "builtin_corpus_paths",
    "check_sources",
    "count_windows",
    "doc_split",
    "iter_documents",
    "iter_eval_batches",
    "load_tokenizer",
    "load_tokens",
    "mixture_counts",
    "mixture_report",
    "mixture_schedule",
    "open_source",
    "parse_source_spec",
    "prepare_data",
    "prepared_data",
    "read_meta",
    "resolve_paths",
    "source_kind",
    "token_dtype",
    "train_bpe",
    "train_loader",
    "validate_source",
    "write_shards",
]

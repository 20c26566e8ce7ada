"""Training data: the user's files to token ids, rows and pipeline batches.

- stream.py: byte / pre-tokenized token streams in fixed windows (the built-in corpus, .bin, .npy)
- sources.py: documents of text files and folders, JSON Lines, Parquet / Arrow tables
- masks.py: a document's token ids and loss mask, token for token as TRL 1.16's SFT preparation
- tokenize.py: the model directory's tokenizer, tokenizing in worker processes
- chat_template.py: that tokenizer with the user's chat template, as a folder of its own
- cache.py: the tokenized corpus, written once and memory-mapped by every run and rank
- packing.py: documents into packed fixed-length rows (or one per row), segment and position ids
- batches.py: a resumable global order, micro-batches and the per-token loss
"""

from pipezero.train.data.batches import GlobalOrder, PackedBatches, token_mean_loss
from pipezero.train.data.chat_template import read_chat_template, with_chat_template
from pipezero.train.data.cache import TokenizedCorpus, cache_key, default_cache_dir, tokenized_corpus
from pipezero.train.data.packing import IGNORE, Layout, MemoryCorpus, Row, pack
from pipezero.train.data.sources import Document, data_files, read_documents
from pipezero.train.data.stream import (ShardedBatches, TokenData, corpus_hash, load_tokens, stdlib_corpus,
                                        stdlib_files)
from pipezero.train.data.tokenize import encode, encode_many, load_tokenizer, tokenizer_hash

__all__ = ["Document", "GlobalOrder", "IGNORE", "Layout", "MemoryCorpus", "PackedBatches", "Row", "ShardedBatches",
           "TokenData", "TokenizedCorpus", "cache_key", "corpus_hash", "data_files", "default_cache_dir", "encode",
           "encode_many", "load_tokenizer", "load_tokens", "pack", "read_documents", "stdlib_corpus", "stdlib_files",
           "read_chat_template", "token_mean_loss", "tokenized_corpus", "tokenizer_hash",
           "with_chat_template"]

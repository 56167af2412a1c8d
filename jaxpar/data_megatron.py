"""Megatron-LM indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``): reader, writer and GPT sample windows.

Corpora tokenized for Megatron-LM (``tools/preprocess_data.py``) are read directly, so a run here
consumes the same tokens in the same sample order as a Megatron run: a like-for-like comparison.

The ``.idx`` layout (``megatron/core/datasets/indexed_dataset.py``, ``_IndexWriter``), little-endian::

    9 bytes    magic b"MMIDIDX\\x00\\x00"
    uint64     version, always 1
    uint8      dtype code of the tokens in .bin (see DTYPE_CODES)
    uint64     N, the number of sequences
    uint64     D, the length of the document index (= number of documents + 1: it starts with 0)
    int32[N]   sequence lengths in tokens
    int64[N]   byte offset of each sequence in .bin
    int64[D]   document index: document d is sequences [index[d], index[d+1])
    int8[N]    sequence modes, multimodal datasets only (accepted and ignored here)

GPT training treats every *sequence* as a document (``GPTDataset.numel_low_level_dataset``); without
``--split-sentences`` each document is one sequence. Numpy only.
"""

from __future__ import annotations

import functools
import os
import struct
from collections.abc import Iterable

import numpy as np

from jaxpar.config import ConfigError
from jaxpar.files import check as check_file

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_BYTES = 9 + 8 + 1 + 8 + 8
# megatron.core.datasets.indexed_dataset.DType (codes are part of the on-disk format).
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
CODE_OF_DTYPE = {dtype: code for code, dtype in DTYPE_CODES.items()}


def _bad(path: str, problem: str) -> ConfigError:
    return ConfigError(
        f"data.path: {problem} ('{path}'); rebuild it with Megatron's tools/preprocess_data.py or "
        "jaxpar.data_megatron.write_megatron_dataset, or point data.path at the right PREFIX"
    )


class MegatronIndexedDataset:
    """Memory-mapped reader for one ``PREFIX.bin`` / ``PREFIX.idx`` pair; only the index is read
    eagerly. Checks the index against the data file on open (magic, version, dtype code, sizes,
    document index), so a corrupt or mismatched pair is a :class:`ConfigError` at start-up."""

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = os.fspath(prefix)
        idx_path, bin_path = self.prefix + ".idx", self.prefix + ".bin"
        fix = "set --config.data.path to the Megatron PREFIX (the path without .bin/.idx) of an existing dataset"
        for path in (idx_path, bin_path):
            if not os.path.lexists(path):
                raise ConfigError(f"data.path: '{path}' not found; {fix}")
            check_file(path, "token data", "data.path", fix)  # a FIFO or device: one line, not a hang
        idx = np.memmap(idx_path, dtype=np.uint8, mode="r") if os.path.getsize(idx_path) else np.zeros(0, np.uint8)
        if len(idx) < HEADER_BYTES:
            raise _bad(idx_path, f"index is {len(idx)} bytes, shorter than the {HEADER_BYTES}-byte header")
        if bytes(idx[:9]) != INDEX_MAGIC:
            raise _bad(idx_path, f"bad magic {bytes(idx[:9])!r}, expected {INDEX_MAGIC!r}: not a Megatron index")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", bytes(idx[9:HEADER_BYTES]))
        if version != INDEX_VERSION:
            raise _bad(idx_path, f"index version {version}, only version {INDEX_VERSION} exists")
        if code not in DTYPE_CODES:
            raise _bad(idx_path, f"unknown dtype code {code}, expected one of {sorted(DTYPE_CODES)}")
        self.dtype = DTYPE_CODES[code]
        expected = HEADER_BYTES + 12 * n_seq + 8 * n_doc
        if len(idx) not in (expected, expected + n_seq):  # + n_seq: multimodal modes
            raise _bad(
                idx_path,
                f"index is {len(idx)} bytes but its header ({n_seq} sequences, {n_doc} "
                f"document-index entries) implies {expected}",
            )
        self.sequence_lengths = np.frombuffer(idx, np.int32, n_seq, HEADER_BYTES)
        self.sequence_pointers = np.frombuffer(idx, np.int64, n_seq, HEADER_BYTES + 4 * n_seq)
        self.document_indices = np.frombuffer(idx, np.int64, n_doc, HEADER_BYTES + 12 * n_seq)
        docs = self.document_indices
        if n_doc < 1 or docs[0] != 0 or docs[-1] != n_seq or np.any(np.diff(docs) < 0):
            raise _bad(idx_path, f"document index must rise from 0 to the sequence count {n_seq}")
        if n_seq and (self.sequence_lengths.min() < 0 or self.sequence_pointers[0] != 0):
            raise _bad(idx_path, "negative sequence length or first sequence not at byte 0")
        itemsize = self.dtype.itemsize
        need = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * itemsize if n_seq else 0
        have = os.path.getsize(bin_path)
        if have != need:
            raise _bad(
                bin_path, f".bin is {have} bytes but the index describes {need}: truncated or from another dataset"
            )
        self.tokens = np.memmap(bin_path, dtype=self.dtype, mode="r") if have else np.zeros(0, self.dtype)

    def __len__(self) -> int:
        """Number of sequences (what Megatron's GPTDataset calls documents)."""
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        """Number of documents in the document index (each one or more sequences)."""
        return len(self.document_indices) - 1

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``i`` as a read-only view of the memmap."""
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        stop = start + (int(self.sequence_lengths[i]) - offset if length is None else length)
        return self.tokens[start:stop]

    def __getitem__(self, i: int) -> np.ndarray:
        """Sequence ``i`` as a memmap view (Megatron's ``IndexedDataset[i]``)."""
        return self.get(i)

    @functools.cached_property
    def _document_bounds(self) -> np.ndarray:
        starts = np.append(self.sequence_pointers // self.dtype.itemsize, len(self.tokens))
        return starts[self.document_indices]

    def document_boundaries(self) -> np.ndarray:
        """Token offset in .bin where each document starts, plus the total token count at the end."""
        return self._document_bounds

    def document(self, d: int) -> np.ndarray:
        """All tokens of document ``d`` (its sequences are contiguous in .bin) as a memmap view."""
        return self.tokens[self._document_bounds[d] : self._document_bounds[d + 1]]


def write_megatron_dataset(prefix: str | os.PathLike, documents: Iterable[np.ndarray], dtype: np.dtype | str) -> None:
    """Write ``PREFIX.bin`` / ``PREFIX.idx``, byte-identical to Megatron's ``IndexedDatasetBuilder``.

    Each document becomes one sequence (``builder.add_document(doc, [len(doc)])``, i.e. preprocessing
    without ``--split-sentences``). ``documents`` may be a generator, so large corpora stream through.
    Both files are written to temporary names and renamed, so readers never see a half-written pair.
    """
    dtype = np.dtype(dtype)
    if dtype not in CODE_OF_DTYPE:
        raise ValueError(f"dtype {dtype} has no Megatron code; use one of {sorted(map(str, CODE_OF_DTYPE))}")
    prefix = os.fspath(prefix)
    lengths: list[int] = []
    with open(prefix + ".bin.tmp", "wb") as f:
        for doc in documents:
            raw = np.asarray(doc)
            arr = raw.astype(dtype)
            if raw.size and not np.array_equal(arr, raw):
                raise ValueError(f"document {len(lengths)} has values that do not fit {dtype}")
            f.write(arr.tobytes(order="C"))
            lengths.append(arr.size)
    lens = np.array(lengths, dtype=np.int64)
    pointers = np.concatenate([[0], np.cumsum(lens * dtype.itemsize)[:-1]]).astype(np.int64)
    with open(prefix + ".idx.tmp", "wb") as f:
        f.write(INDEX_MAGIC + struct.pack("<QBQQ", INDEX_VERSION, CODE_OF_DTYPE[dtype], len(lens), len(lens) + 1))
        f.write(lens.astype(np.int32).tobytes() + pointers[: len(lens)].tobytes())
        f.write(np.arange(len(lens) + 1, dtype=np.int64).tobytes())
    os.replace(prefix + ".bin.tmp", prefix + ".bin")
    os.replace(prefix + ".idx.tmp", prefix + ".idx")


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer: a fixed, platform-independent hash of uint64 values (vectorized)."""
    x = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def split_sequences(dataset: MegatronIndexedDataset, val_fraction: float) -> dict[str, np.ndarray]:
    """Sequence ids of the train and validation splits, held out by WHOLE document.

    A document is validation iff ``hash(document index) % 10_000 < val_fraction * 10_000``; all its
    sequences go with it, so no document is in both splits, and the split does not depend on the seed
    (evaluations stay comparable across runs).
    """
    is_val_doc = (_mix64(np.arange(dataset.num_documents)) % np.uint64(10_000)) < val_fraction * 10_000
    is_val = np.repeat(is_val_doc, np.diff(dataset.document_indices))
    ids = np.arange(len(dataset), dtype=np.int64)
    return {"train": ids[~is_val], "validation": ids[is_val]}


def epoch_seed(seed: int, epoch: int) -> int:
    """RandomState seed of an epoch: ``seed`` itself for epoch 0 (as Megatron), a derived one after."""
    if epoch == 0 and 0 <= seed < 2**32:
        return seed
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])


class GPTSamples:
    """One epoch of Megatron ``GPTDataset`` samples over a subset of sequences.

    Mirrors ``GPTDataset._build_document_sample_shuffle_indices`` for one epoch: ``RandomState(seed)``
    shuffles the sequence ids (``document_index``), which are concatenated and cut into
    ``(total - 1) // seq_len`` windows of ``seq_len + 1`` tokens starting at ``j * seq_len``; the
    same RandomState then shuffles the window order (``shuffle_index``). ``seed=None`` keeps both
    orders (evaluation). Only per-sequence offsets are kept, not Megatron's sample table
    (:meth:`sample_index`): 8 bytes per sequence plus 4 per sample.
    """

    def __init__(
        self, dataset: MegatronIndexedDataset, sequence_ids: np.ndarray, seq_len: int, seed: int | None
    ) -> None:
        self.dataset, self.seq_len = dataset, seq_len
        rs = None if seed is None else np.random.RandomState(seed)
        self.document_index = np.asarray(sequence_ids).astype(np.int32)
        if rs is not None:
            rs.shuffle(self.document_index)
        lengths = dataset.sequence_lengths[self.document_index].astype(np.int64)
        self.starts = np.concatenate([[0], np.cumsum(lengths)])  # token offset of each sequence in the epoch
        self.num_samples = max(int(self.starts[-1]) - 1, 0) // seq_len
        big = self.num_samples >= np.iinfo(np.uint32).max - 1
        self.shuffle_index = np.arange(self.num_samples, dtype=np.int64 if big else np.uint32)
        if rs is not None:
            rs.shuffle(self.shuffle_index)

    def sample_index(self) -> np.ndarray:
        """Megatron's ``sample_index`` table: (num_samples + 1, 2) of (position in document_index, offset)."""
        pos = np.arange(self.num_samples + 1, dtype=np.int64) * self.seq_len
        doc = np.searchsorted(self.starts, pos, side="right") - 1
        return np.stack([doc, pos - self.starts[doc]], axis=1)

    def tokens(self, j: int) -> np.ndarray:
        """Window ``j`` (unshuffled position): ``seq_len + 1`` tokens as int32, read from the memmap."""
        pos, need = j * self.seq_len, self.seq_len + 1
        k = int(np.searchsorted(self.starts, pos, side="right")) - 1
        offset, parts = pos - int(self.starts[k]), []
        while need:
            part = self.dataset.get(int(self.document_index[k]), offset)[:need]
            parts.append(part)
            need -= len(part)
            k, offset = k + 1, 0
        return np.concatenate(parts).astype(np.int32)

    def document_starts(self, j: int) -> np.ndarray:
        """Offsets inside window ``j`` where a sequence (document) begins; 0 only if the window starts on one.

        For block-diagonal (per-document) attention masks and position-id resets.
        """
        pos = j * self.seq_len
        lo, hi = np.searchsorted(self.starts[:-1], [pos, pos + self.seq_len + 1], side="left")
        return np.unique(self.starts[lo:hi] - pos)

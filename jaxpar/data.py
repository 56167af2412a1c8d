"""Token sources and the deterministic, resumable, host-sharded batch iterator.

Sources (``data.source``):

* ``stdlib``: the running Python's standard library ``*.py`` files as bytes (vocab 256): real text
  on every machine, no download. Split by file hash, cached.
* ``synthetic``: seeded pseudo-random tokens over the model vocab, for throughput benchmarks.
* ``bin``: a nanoGPT-style flat token file (``np.memmap``); validation is its last ``val_fraction``.
* ``megatron``: a Megatron-LM indexed dataset, sampled the GPTDataset way (:mod:`jaxpar.data_megatron`).

The batch at step ``k`` is a pure function of ``(source, seed, k)``: resuming needs only the step
(no loader state in checkpoints), a restart reproduces the run bit for bit, and each process reads
only *its* rows of the global batch. Numpy only.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import sys
import sysconfig
import tempfile
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
from ml_collections import ConfigDict

from jaxpar import write_guard
from jaxpar.config import ConfigError
from jaxpar.data_megatron import GPTSamples, MegatronIndexedDataset, epoch_seed, split_sequences
from jaxpar.files import check as check_file

SPLITS = ("train", "validation")
TOKEN_DTYPES = {"uint16": np.dtype(np.uint16), "uint32": np.dtype(np.uint32)}
VAL_BUCKETS = 10_000
CHECK_TOKENS = 1_000_000  # tokens scanned for out-of-vocab ids when a file is opened
_SEPARATOR = b"\n\n"
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages"})


# --------------------------------------------------------------------------- stdlib corpus


def stdlib_root() -> pathlib.Path:
    """Directory of the running interpreter's pure-Python standard library."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(val_fraction: float, root: str | os.PathLike | None = None) -> dict[str, list[str]]:
    """Relative paths (posix, sorted) of the stdlib ``*.py`` files in each split.

    A file is validation iff ``zlib.crc32(path.encode()) % 10_000 < val_fraction * 10_000``: a whole
    file is in exactly one split, and the assignment is stable across machines and Python versions.
    ``site-packages`` / ``dist-packages`` are skipped (installed packages are not the corpus).
    """
    base = pathlib.Path(root) if root is not None else stdlib_root()
    paths = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        rel_dir = pathlib.Path(dirpath).relative_to(base)
        paths += [(rel_dir / name).as_posix() for name in filenames if name.endswith(".py")]
    splits: dict[str, list[str]] = {"train": [], "validation": []}
    for rel in sorted(paths):
        is_val = zlib.crc32(rel.encode()) % VAL_BUCKETS < val_fraction * VAL_BUCKETS
        splits["validation" if is_val else "train"].append(rel)
    return splits


def default_cache_dir() -> pathlib.Path:
    """``$JAXPAR_CACHE_DIR`` or ``~/.cache/jaxpar``: prepared data, and jaxpar's other small verdicts."""
    return pathlib.Path(os.environ.get("JAXPAR_CACHE_DIR") or pathlib.Path.home() / ".cache" / "jaxpar")


def _save_atomic(path: pathlib.Path, array: np.ndarray) -> None:
    """np.save via a temporary file in the same directory + os.replace: readers never see a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with write_guard.naming(path), os.fdopen(fd, "wb") as f:  # a full disk: one line naming the cache file
            np.save(f, array)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_stdlib(
    val_fraction: float, root: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None
) -> dict[str, np.ndarray]:
    """The stdlib corpus as ``{"train": uint8[...], "validation": uint8[...]}`` (bytes are tokens),
    a split's files joined with ``b"\\n\\n"``. Cached as ``.npy`` under :func:`default_cache_dir`
    (key: Python version, stdlib path, val_fraction) and memory-mapped from there; an unwritable
    cache is not an error (the corpus is rebuilt next time).
    """
    base = pathlib.Path(root) if root is not None else stdlib_root()
    key = hashlib.sha256(f"{sys.version}|{base.resolve()}|{val_fraction!r}".encode()).hexdigest()[:16]
    cache = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
    paths = {split: cache / f"stdlib-{key}-{split}.npy" for split in SPLITS}
    if all(p.is_file() for p in paths.values()):
        try:
            return {split: np.load(p, mmap_mode="r") for split, p in paths.items()}
        except (OSError, ValueError):
            pass  # a damaged cache entry: rebuild it below
    if not base.is_dir():
        raise ConfigError(
            f"data.source='stdlib' but the stdlib directory '{base}' is missing; "
            "use --config.data.source=synthetic or bin"
        )
    files = stdlib_files(val_fraction, base)
    if not files["train"] and not files["validation"]:
        raise ConfigError(
            f"data.source='stdlib' but '{base}' holds no *.py files; use --config.data.source=synthetic or bin"
        )
    out = {}
    for split in SPLITS:
        blob = _SEPARATOR.join((base / rel).read_bytes() for rel in files[split])
        out[split] = np.frombuffer(blob, dtype=np.uint8)
        try:
            _save_atomic(paths[split], out[split])
        except OSError:
            pass
    return out


# --------------------------------------------------------------------------- token files


def check_token_range(tokens: np.ndarray, vocab_size: int, where: str) -> None:
    """Fail fast if the first ``CHECK_TOKENS`` tokens hold an id outside ``[0, vocab_size)``.

    An out-of-range id would otherwise index past the embedding table silently (JAX clamps gathers).
    """
    head = np.asarray(tokens[:CHECK_TOKENS])
    if head.size and int(head.min()) < 0:
        raise ConfigError(f"data.path: {where} holds the negative token id {int(head.min())}; re-tokenize the data")
    if head.size and int(head.max()) >= vocab_size:
        raise ConfigError(
            f"model.vocab_size={vocab_size} but {where} holds token id {int(head.max())}; set "
            f"--config.model.vocab_size to at least {int(head.max()) + 1} (or check data.token_dtype / data.path)"
        )


def load_bin(path: str, token_dtype: str, val_fraction: float, vocab_size: int) -> dict[str, np.ndarray]:
    """A flat token file as memmap views: train = the first ``1 - val_fraction``, validation = the rest."""
    fix = "set --config.data.path to a flat token .bin file"
    if not os.path.lexists(path):
        raise ConfigError(f"data.path: '{path}' not found; {fix}")
    check_file(path, "token data", "data.path", fix)  # a FIFO or device: one line, not a hang in np.memmap
    dtype = TOKEN_DTYPES[token_dtype]
    size = os.path.getsize(path)
    if size == 0:
        raise ConfigError(f"data.path: '{path}' is empty; point data.path at a tokenized .bin file")
    if size % dtype.itemsize:
        other = "uint32" if token_dtype == "uint16" else "uint16"
        raise ConfigError(
            f"data.token_dtype='{token_dtype}' but '{path}' is {size} bytes, not a multiple of "
            f"{dtype.itemsize}; set --config.data.token_dtype={other} or check the file is complete"
        )
    tokens = np.memmap(path, dtype=dtype, mode="r")
    check_token_range(tokens, vocab_size, f"data.path '{path}'")
    n_val = int(len(tokens) * val_fraction)
    return {"train": tokens[: len(tokens) - n_val], "validation": tokens[len(tokens) - n_val :]}


def open_megatron(path: str, val_fraction: float, vocab_size: int) -> tuple[MegatronIndexedDataset, dict]:
    """Open a Megatron dataset (``path`` = PREFIX, a trailing .bin/.idx is tolerated) and split it."""
    prefix = path[:-4] if path.endswith((".bin", ".idx")) else path
    dataset = MegatronIndexedDataset(prefix)
    if dataset.dtype.kind not in "iu":
        raise ConfigError(f"data.path: '{prefix}' holds {dataset.dtype} values, not token ids; re-tokenize it")
    check_token_range(dataset.tokens, vocab_size, f"data.path '{prefix}.bin'")
    return dataset, split_sequences(dataset, val_fraction)


# --------------------------------------------------------------------------- batch iterator

# A row reader: (step, first_row, stop_row) -> int32[stop_row - first_row, seq_len + 1].
RowReader = Callable[[int, int, int], np.ndarray]


class Batches:
    """Local rows of the global batch, step after step; ``state()`` / ``restore()`` for resumption.

    ``next()`` returns int32 ``(global_batch // process_count, seq_len + 1)``: inputs ``[:, :-1]``,
    targets ``[:, 1:]``. Process ``i`` gets global rows ``[i * local, (i + 1) * local)``.
    """

    def __init__(
        self,
        read_rows: RowReader,
        *,
        source: str,
        split: str,
        seed: int,
        global_batch: int,
        process_index: int,
        process_count: int,
        doc_starts: Callable[[int, int], np.ndarray] | None = None,
    ) -> None:
        self._read_rows, self._doc_starts = read_rows, doc_starts
        self.source, self.split, self.seed = source, split, seed
        self.local_batch = global_batch // process_count
        self.first_row = process_index * self.local_batch
        self.step = 0

    def batch(self, step: int) -> np.ndarray:
        """The local batch of ``step`` (pure: does not move the iterator)."""
        return self._read_rows(step, self.first_row, self.first_row + self.local_batch)

    def next(self) -> np.ndarray:
        """The local batch of the current step, then advance one step."""
        out = self.batch(self.step)
        self.step += 1
        return out

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> np.ndarray:
        return self.next()

    def document_starts(self, step: int) -> list[np.ndarray] | None:
        """Per local row of ``step``: offsets where a document begins (megatron only, else None)."""
        if self._doc_starts is None:
            return None
        return [self._doc_starts(step, r) for r in range(self.first_row, self.first_row + self.local_batch)]

    def state(self) -> dict[str, Any]:
        """JSON-serialisable position: the next step to produce, plus what it is only valid for."""
        return {"step": self.step, "source": self.source, "split": self.split, "seed": self.seed}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a ``state()``; refuses one written for another source, split or seed."""
        for key, field in (("source", "data.source"), ("split", "split"), ("seed", "train.seed")):
            if key in state and state[key] != getattr(self, key):
                raise ConfigError(
                    f"{field}: the saved data state has {key}={state[key]!r} but this run uses "
                    f"{getattr(self, key)!r}; resume with the same {field} or start afresh"
                )
        self.step = int(state["step"])


def _check_args(seq_len: int, global_batch: int, seed: int, split: str, process_index: int, process_count: int) -> None:
    if split not in SPLITS:
        raise ConfigError(f"split='{split}': use one of {', '.join(SPLITS)}")
    if seq_len < 1:
        raise ConfigError(f"train.seq_len={seq_len}: must be >= 1")
    if seed < 0:
        raise ConfigError(f"train.seed={seed}: must be >= 0")
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ConfigError(f"process_index={process_index} / process_count={process_count}: need 0 <= index < count")
    if global_batch < 1 or global_batch % process_count:
        raise ConfigError(
            f"train.global_batch={global_batch} is not a positive multiple of the process count "
            f"{process_count}; use a multiple of {process_count}"
        )


def _too_short(n: int, seq_len: int, split: str) -> ConfigError:
    return ConfigError(
        f"train.seq_len={seq_len}: the {split} split has only {n} tokens, fewer than seq_len + 1; "
        "lower train.seq_len or adjust data.val_fraction / data.path"
    )


def _window_reader(tokens: np.ndarray, seq_len: int, offsets: Callable[[int], np.ndarray]) -> RowReader:
    """Rows are ``tokens[o : o + seq_len + 1]`` for the step's offsets; only the requested rows are read."""

    def read(step: int, lo: int, hi: int) -> np.ndarray:
        starts = offsets(step)[lo:hi]
        return np.stack([np.asarray(tokens[o : o + seq_len + 1]) for o in starts]).astype(np.int32)

    return read


def _synthetic_reader(vocab_size: int, seq_len: int, seed: int, tag: int) -> RowReader:
    """Row ``r`` of step ``k`` is drawn from its own Generator(seed, tag, k, r): no row depends on another."""

    def read(step: int, lo: int, hi: int) -> np.ndarray:
        rows = [np.random.default_rng([seed, tag, step, r]).integers(0, vocab_size, seq_len + 1) for r in range(lo, hi)]
        return np.stack(rows).astype(np.int32)

    return read


class _MegatronSampler:
    """Global sample ``g = step * global_batch + row``: epoch ``g // n``, shuffled window of that epoch."""

    def __init__(
        self, dataset: MegatronIndexedDataset, ids: np.ndarray, seq_len: int, seed: int, global_batch: int
    ) -> None:
        self.dataset, self.ids, self.seq_len, self.seed, self.global_batch = dataset, ids, seq_len, seed, global_batch
        self._epochs: dict[int, GPTSamples] = {}
        self.per_epoch = self.epoch(0).num_samples

    def epoch(self, e: int) -> GPTSamples:
        if e not in self._epochs:
            if len(self._epochs) >= 2:  # keep two: a batch normally spans at most two epochs
                self._epochs.pop(min(self._epochs))
            self._epochs[e] = GPTSamples(self.dataset, self.ids, self.seq_len, epoch_seed(self.seed, e))
        return self._epochs[e]

    def locate(self, step: int, row: int) -> tuple[GPTSamples, int]:
        e, j = divmod(step * self.global_batch + row, self.per_epoch)
        samples = self.epoch(e)
        return samples, int(samples.shuffle_index[j])

    def read(self, step: int, lo: int, hi: int) -> np.ndarray:
        return np.stack([s.tokens(j) for s, j in (self.locate(step, r) for r in range(lo, hi))])

    def doc_starts(self, step: int, row: int) -> np.ndarray:
        samples, j = self.locate(step, row)
        return samples.document_starts(j)


def _open_tokens(data_cfg: ConfigDict, vocab_size: int) -> dict[str, np.ndarray]:
    if data_cfg.source == "stdlib":
        if vocab_size < 256:
            raise ConfigError(f"model.vocab_size={vocab_size} but data.source='stdlib' is bytes; use vocab_size >= 256")
        return load_stdlib(data_cfg.val_fraction)
    return load_bin(data_cfg.path, data_cfg.token_dtype, data_cfg.val_fraction, vocab_size)


def make_batches(
    data_cfg: ConfigDict,
    *,
    vocab_size: int,
    seq_len: int,
    global_batch: int,
    seed: int,
    split: str = "train",
    process_index: int = 0,
    process_count: int = 1,
) -> Batches:
    """The deterministic batch stream of ``split`` for this process (see :class:`Batches`).

    stdlib / bin / synthetic: row ``r`` of step ``k`` is a random window whose start is the ``r``-th draw
    of ``np.random.default_rng([seed, k])`` (``[seed, k, 1]`` for validation). megatron: it is global
    sample ``k * global_batch + r`` of the GPTDataset order, reshuffled every epoch.
    """
    _check_args(seq_len, global_batch, seed, split, process_index, process_count)
    common = dict(
        source=data_cfg.source,
        split=split,
        seed=seed,
        global_batch=global_batch,
        process_index=process_index,
        process_count=process_count,
    )
    tag = SPLITS.index(split)
    if data_cfg.source == "synthetic":
        return Batches(_synthetic_reader(vocab_size, seq_len, seed, tag), **common)
    if data_cfg.source == "megatron":
        dataset, ids = open_megatron(data_cfg.path, data_cfg.val_fraction, vocab_size)
        sampler = _MegatronSampler(dataset, ids[split], seq_len, seed, global_batch)
        if sampler.per_epoch < 1:
            raise _too_short(int(dataset.sequence_lengths[ids[split]].sum()), seq_len, split)
        return Batches(sampler.read, doc_starts=sampler.doc_starts, **common)
    tokens = _open_tokens(data_cfg, vocab_size)[split]
    if len(tokens) < seq_len + 1:
        raise _too_short(len(tokens), seq_len, split)

    def offsets(step: int) -> np.ndarray:
        key = [seed, step] if tag == 0 else [seed, step, tag]
        return np.random.default_rng(key).integers(0, len(tokens) - seq_len, size=global_batch)

    return Batches(_window_reader(tokens, seq_len, offsets), **common)


def eval_batches(
    data_cfg: ConfigDict,
    *,
    vocab_size: int,
    seq_len: int,
    global_batch: int,
    seed: int,
    num_batches: int,
    process_index: int = 0,
    process_count: int = 1,
) -> list[np.ndarray]:
    """A fixed list of ``num_batches`` local validation batches, identical on every call: windows
    spread evenly over the validation split (megatron: over its unshuffled documents), so
    bits-per-byte covers the whole held-out set and does not depend on ``seed``."""
    _check_args(seq_len, global_batch, seed, "validation", process_index, process_count)
    common = dict(
        source=data_cfg.source,
        split="validation",
        seed=seed,
        global_batch=global_batch,
        process_index=process_index,
        process_count=process_count,
    )
    count = num_batches * global_batch
    if data_cfg.source == "synthetic":
        batches = Batches(_synthetic_reader(vocab_size, seq_len, seed, tag=2), **common)
    elif data_cfg.source == "megatron":
        dataset, ids = open_megatron(data_cfg.path, data_cfg.val_fraction, vocab_size)
        samples = GPTSamples(dataset, ids["validation"], seq_len, seed=None)
        if samples.num_samples < 1:
            raise _too_short(int(samples.starts[-1]), seq_len, "validation")
        picks = (np.arange(count) * samples.num_samples // max(count, 1)) % samples.num_samples

        def read(step: int, lo: int, hi: int) -> np.ndarray:
            return np.stack([samples.tokens(int(j)) for j in picks[step * global_batch :][lo:hi]])

        batches = Batches(read, **common)
    else:
        tokens = _open_tokens(data_cfg, vocab_size)["validation"]
        if len(tokens) < seq_len + 1:
            raise _too_short(len(tokens), seq_len, "validation")
        last = len(tokens) - seq_len - 1
        starts = np.arange(count, dtype=np.int64) * last // max(count - 1, 1)
        batches = Batches(
            _window_reader(tokens, seq_len, lambda step: starts[step * global_batch : (step + 1) * global_batch]),
            **common,
        )
    return [batches.batch(step) for step in range(num_batches)]

"""Tests for jaxpar.data / jaxpar.data_megatron: sources, splits, determinism, resumption, sharding, errors.

All fixtures are made in tmp directories; numpy only (no jax), so the file runs in a few seconds.
"""

from __future__ import annotations

import json
import struct
import time
import zlib

import numpy as np
import pytest

from jaxpar import data, data_megatron
from jaxpar.config import ConfigError, default_config
from jaxpar.data_megatron import GPTSamples, MegatronIndexedDataset, write_megatron_dataset

SEQ = 16
VOCAB = 1000


def data_cfg(**fields):
    cfg = default_config().data
    for key, value in fields.items():
        cfg[key] = value
    return cfg


@pytest.fixture(scope="module")
def stdlib_cache(tmp_path_factory):
    """Point the stdlib cache at a temp dir for the whole module (built once, then memory-mapped)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXPAR_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture
def bin_path(tmp_path):
    path = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, VOCAB, 20_000).astype(np.uint16).tofile(path)
    return str(path)


@pytest.fixture
def mega_prefix(tmp_path):
    """80 documents of lengths 1..60; every token of document d equals d, so rows reveal their documents."""
    lengths = np.random.default_rng(1).integers(1, 61, 80)
    prefix = str(tmp_path / "corpus_text_document")
    write_megatron_dataset(prefix, [np.full(n, d) for d, n in enumerate(lengths)], np.uint16)
    return prefix


def make_cfg(source, bin_path, mega_prefix):
    path = {"bin": bin_path, "megatron": mega_prefix}.get(source, "")
    return data_cfg(source=source, path=path, val_fraction=0.25 if source == "megatron" else 0.05)


SOURCES = ["synthetic", "bin", "megatron", "stdlib"]


def batches(cfg, seed=0, global_batch=8, **kw):
    return data.make_batches(cfg, vocab_size=VOCAB, seq_len=SEQ, global_batch=global_batch, seed=seed, **kw)


# --------------------------------------------------------------------------- stdlib


def test_stdlib_split_is_disjoint_by_file_and_deterministic():
    first, second = data.stdlib_files(0.05), data.stdlib_files(0.05)
    assert first == second
    train, val = set(first["train"]), set(first["validation"])
    assert train and val and not train & val
    assert first["train"] == sorted(first["train"])
    assert all(zlib.crc32(p.encode()) % 10_000 < 500 for p in val)
    assert all(zlib.crc32(p.encode()) % 10_000 >= 500 for p in train)
    assert not any("site-packages" in p or "dist-packages" in p for p in train | val)
    assert 0.02 < len(val) / (len(train) + len(val)) < 0.09


def test_stdlib_corpus_joins_files_and_caches(tmp_path):
    root, cache = tmp_path / "lib", tmp_path / "cache"
    files = {"a.py": b"A = 1\n", "pkg/b.py": b"B", "pkg/c.py": b"C = 3", "z/d.py": b"D"}
    for rel, text in {**files, "site-packages/x.py": b"X", "notes.txt": b"T"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(text)
    split = {rel: zlib.crc32(rel.encode()) % 10_000 < 0.5 * 10_000 for rel in files}
    corpus = data.load_stdlib(0.5, root=root, cache_dir=cache)
    for name, is_val in (("train", False), ("validation", True)):
        expected = b"\n\n".join(files[rel] for rel in sorted(files) if split[rel] == is_val)
        assert corpus[name].dtype == np.uint8 and corpus[name].tobytes() == expected
    assert len(list(cache.glob("*.npy"))) == 2 and not list(cache.glob("*.tmp"))
    for path in root.rglob("*.py"):  # the second load must come from the cache alone
        path.unlink()
    again = data.load_stdlib(0.5, root=root, cache_dir=cache)
    assert all(isinstance(again[s], np.memmap) and np.array_equal(again[s], corpus[s]) for s in data.SPLITS)


def test_stdlib_missing_or_empty_names_data_source(tmp_path):
    with pytest.raises(ConfigError, match="data.source"):
        data.load_stdlib(0.05, root=tmp_path / "nowhere", cache_dir=tmp_path / "c")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="data.source"):
        data.load_stdlib(0.05, root=tmp_path / "empty", cache_dir=tmp_path / "c")


def test_stdlib_batches_are_bytes_and_second_load_is_instant(stdlib_cache):
    first = batches(data_cfg()).next()
    assert first.shape == (8, SEQ + 1) and first.dtype == np.int32 and 0 <= first.min() and first.max() < 256
    start = time.perf_counter()
    data.load_stdlib(0.05)
    assert time.perf_counter() - start < 0.5
    with pytest.raises(ConfigError, match="model.vocab_size"):
        data.make_batches(data_cfg(), vocab_size=100, seq_len=SEQ, global_batch=8, seed=0)


# --------------------------------------------------------------------------- the iterator, every source


@pytest.mark.parametrize("source", SOURCES)
def test_same_seed_same_batches(source, bin_path, mega_prefix, stdlib_cache):
    cfg = make_cfg(source, bin_path, mega_prefix)
    a, b, other = batches(cfg), batches(cfg), batches(cfg, seed=1)
    for _ in range(3):
        x, y = a.next(), b.next()
        assert x.shape == (8, SEQ + 1) and x.dtype == np.int32 and x.max() < VOCAB
        assert np.array_equal(x, y)
    assert not np.array_equal(x, other.batch(2))
    assert not np.array_equal(x, batches(cfg, split="validation").batch(2))


@pytest.mark.parametrize("source", SOURCES)
def test_restore_resumes_exactly(source, bin_path, mega_prefix, stdlib_cache):
    cfg = make_cfg(source, bin_path, mega_prefix)
    uninterrupted = batches(cfg, global_batch=4)
    stream = [uninterrupted.next() for _ in range(40)]  # 160 megatron samples: crosses an epoch boundary
    interrupted = batches(cfg, global_batch=4)
    for _ in range(30):
        interrupted.next()
    saved = json.loads(json.dumps(interrupted.state()))
    resumed = batches(cfg, global_batch=4)
    resumed.restore(saved)
    assert saved["step"] == 30
    for k in range(30, 40):
        assert np.array_equal(resumed.next(), stream[k])
    with pytest.raises(ConfigError, match="train.seed"):
        batches(cfg, seed=5).restore(saved)


@pytest.mark.parametrize("process_count", [2, 4])
@pytest.mark.parametrize("source", SOURCES)
def test_process_shards_union_is_the_global_batch(source, process_count, bin_path, mega_prefix, stdlib_cache):
    cfg = make_cfg(source, bin_path, mega_prefix)
    single = batches(cfg)
    shards = [batches(cfg, process_index=i, process_count=process_count) for i in range(process_count)]
    for step in range(3):
        parts = [shard.next() for shard in shards]
        assert all(p.shape == (8 // process_count, SEQ + 1) for p in parts)
        assert np.array_equal(np.concatenate(parts), single.next()), step


def test_a_process_reads_only_its_own_rows(mega_prefix, monkeypatch):
    class Recorder(np.ndarray):
        slices: list = []

        def __getitem__(self, item):
            Recorder.slices.append(item)
            return super().__getitem__(item)

    tokens = np.arange(1000).view(Recorder)
    offsets = lambda step: np.random.default_rng([0, step]).integers(0, 1000 - SEQ, 8)  # noqa: E731
    rows = data._window_reader(tokens, SEQ, offsets)(3, 4, 6)
    assert len(Recorder.slices) == 2 and np.array_equal(rows[:, 0], offsets(3)[4:6])
    calls = []
    original = GPTSamples.tokens
    monkeypatch.setattr(GPTSamples, "tokens", lambda self, j: calls.append(j) or original(self, j))
    batches(make_cfg("megatron", "", mega_prefix), process_index=1, process_count=4).next()
    assert len(calls) == 2


def test_global_batch_must_divide_over_processes():
    with pytest.raises(ConfigError, match="train.global_batch"):
        batches(data_cfg(source="synthetic"), global_batch=6, process_count=4)


@pytest.mark.parametrize("source", SOURCES)
def test_eval_batches_are_fixed(source, bin_path, mega_prefix, stdlib_cache):
    cfg = make_cfg(source, bin_path, mega_prefix)
    kw = dict(vocab_size=VOCAB, seq_len=SEQ, global_batch=4, seed=0, num_batches=3)
    first, second = data.eval_batches(cfg, **kw), data.eval_batches(cfg, **kw)
    assert len(first) == 3 and all(b.shape == (4, SEQ + 1) and b.dtype == np.int32 for b in first)
    assert all(np.array_equal(a, b) for a, b in zip(first, second))
    shard = data.eval_batches(cfg, **kw, process_index=1, process_count=2)
    assert all(np.array_equal(s, b[2:]) for s, b in zip(shard, first))


# --------------------------------------------------------------------------- bin


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_memmap_round_trip(dtype, tmp_path):
    vocab = 70_000 if dtype == "uint32" else 60_000
    tokens = np.random.default_rng(2).integers(0, vocab, 10_000).astype(dtype)
    tokens.tofile(tmp_path / "t.bin")
    split = data.load_bin(str(tmp_path / "t.bin"), dtype, 0.1, vocab)
    assert isinstance(split["train"], np.memmap) and split["train"].dtype == np.dtype(dtype)
    assert np.array_equal(split["train"], tokens[:9000]) and np.array_equal(split["validation"], tokens[9000:])
    cfg = data_cfg(source="bin", path=str(tmp_path / "t.bin"), token_dtype=dtype, val_fraction=0.1)
    got = data.make_batches(cfg, vocab_size=vocab, seq_len=SEQ, global_batch=4, seed=3).batch(5)
    starts = np.random.default_rng([3, 5]).integers(0, 9000 - SEQ, 4)
    assert np.array_equal(got, np.stack([tokens[s : s + SEQ + 1] for s in starts]).astype(np.int32))


def test_bin_errors_name_the_field(tmp_path, bin_path):
    with pytest.raises(ConfigError, match="data.path"):
        batches(data_cfg(source="bin", path=str(tmp_path / "missing.bin")))
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(ConfigError, match="data.token_dtype"):
        batches(data_cfg(source="bin", path=str(tmp_path / "odd.bin")))
    with pytest.raises(ConfigError, match="model.vocab_size"):
        data.make_batches(data_cfg(source="bin", path=bin_path), vocab_size=10, seq_len=SEQ, global_batch=8, seed=0)


# --------------------------------------------------------------------------- megatron


def idx_bytes(code, lengths, doc_index, itemsize):
    """The .idx layout spelled out independently of the writer (Megatron's _IndexWriter)."""
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]) * itemsize
    return (
        b"MMIDIDX\x00\x00"
        + struct.pack("<Q", 1)
        + struct.pack("<B", code)
        + struct.pack("<Q", len(lengths))
        + struct.pack("<Q", len(doc_index))
        + np.asarray(lengths, "<i4").tobytes()
        + np.asarray(pointers, "<i8").tobytes()
        + np.asarray(doc_index, "<i8").tobytes()
    )


@pytest.mark.parametrize(("dtype", "code"), [(np.uint16, 8), (np.int32, 4)])
def test_megatron_writer_reader_round_trip(dtype, code, tmp_path):
    rng = np.random.default_rng(4)
    docs = [rng.integers(0, 30_000, n).astype(dtype) for n in (1, 7, 300, 2, 45)]
    prefix = tmp_path / "ds"
    write_megatron_dataset(prefix, docs, dtype)
    itemsize = np.dtype(dtype).itemsize
    lengths = [len(d) for d in docs]
    assert (tmp_path / "ds.idx").read_bytes() == idx_bytes(code, lengths, range(len(docs) + 1), itemsize)
    assert (tmp_path / "ds.bin").read_bytes() == b"".join(d.tobytes() for d in docs)
    ds = MegatronIndexedDataset(prefix)
    assert len(ds) == ds.num_documents == 5 and ds.dtype == np.dtype(dtype)
    for i, doc in enumerate(docs):
        assert isinstance(ds[i], np.memmap) and np.array_equal(ds[i], doc) and np.array_equal(ds.document(i), doc)
    assert list(ds.document_boundaries()) == [0, 1, 8, 308, 310, 355]
    assert np.array_equal(ds.get(2, offset=5, length=3), docs[2][5:8])


def megatron_build_sample_idx(sizes, doc_idx, seq_length, num_samples):
    """Megatron's helpers.cpp build_sample_idx (add_extra_token=1), transliterated as the reference."""
    out, doc_pos, offset = [(0, 0)], 0, 0
    while len(out) <= num_samples:
        remaining = seq_length + 1
        while remaining:
            length = sizes[doc_idx[doc_pos]] - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                doc_pos, offset = doc_pos + 1, 0
        out.append((doc_pos, offset))
    return np.array(out)


def test_megatron_windows_follow_gpt_dataset(tmp_path):
    write_megatron_dataset(tmp_path / "t", [[10, 11, 12], [20, 21, 22, 23, 24], [30, 31]], np.uint16)
    ds = MegatronIndexedDataset(tmp_path / "t")
    s = GPTSamples(ds, np.arange(3), seq_len=3, seed=None)  # hand-computed: 10 tokens -> (10 - 1) // 3 windows
    assert s.num_samples == 3
    assert s.sample_index().tolist() == [[0, 0], [1, 0], [1, 3], [2, 1]]
    assert [s.tokens(j).tolist() for j in range(3)] == [[10, 11, 12, 20], [20, 21, 22, 23], [23, 24, 30, 31]]
    assert [s.document_starts(j).tolist() for j in range(3)] == [[0, 3], [0], [2]]
    # A shuffled epoch: one RandomState(seed) shuffles the documents, then the samples (Megatron's order).
    sizes = np.random.default_rng(5).integers(1, 40, 50)
    write_megatron_dataset(tmp_path / "r", [np.zeros(n) for n in sizes], np.uint16)
    s = GPTSamples(MegatronIndexedDataset(tmp_path / "r"), np.arange(50), seq_len=7, seed=1234)
    rs = np.random.RandomState(1234)
    doc_idx = np.arange(50, dtype=np.int32)
    rs.shuffle(doc_idx)
    shuffle = np.arange((sizes.sum() - 1) // 7, dtype=np.uint32)
    rs.shuffle(shuffle)
    assert np.array_equal(s.document_index, doc_idx) and np.array_equal(s.shuffle_index, shuffle)
    assert np.array_equal(s.sample_index(), megatron_build_sample_idx(sizes, doc_idx, 7, s.num_samples))


def test_megatron_train_and_validation_documents_are_disjoint(mega_prefix):
    ds = MegatronIndexedDataset(mega_prefix)
    split = data_megatron.split_sequences(ds, 0.25)
    assert not set(split["train"]) & set(split["validation"]) and len(split["validation"]) > 5
    assert sorted([*split["train"], *split["validation"]]) == list(range(len(ds)))
    cfg = make_cfg("megatron", "", mega_prefix)
    for name in data.SPLITS:  # tokens are document ids: each split's rows only show its own documents
        it = data.make_batches(cfg, vocab_size=VOCAB, seq_len=SEQ, global_batch=8, seed=0, split=name)
        seen = set(np.concatenate([it.next() for _ in range(10)]).ravel().tolist())
        assert seen <= set(split[name].tolist())
    rows = data.make_batches(cfg, vocab_size=VOCAB, seq_len=SEQ, global_batch=1, seed=0)
    for step in range(5):  # reported document starts are exactly where the document id changes
        row, starts = rows.next(), rows.document_starts(step)[0]
        assert set((np.flatnonzero(np.diff(row)) + 1).tolist()) == set(starts.tolist()) - {0}


def test_megatron_whole_multi_sequence_documents_stay_together(tmp_path):
    lengths, doc_index = [3] * 12, [0, 2, 5, 6, 9, 12]  # 5 documents of 2, 3, 1, 3, 3 sequences
    (tmp_path / "m.idx").write_bytes(idx_bytes(8, lengths, doc_index, 2))
    (tmp_path / "m.bin").write_bytes(np.zeros(36, np.uint16).tobytes())
    split = data_megatron.split_sequences(MegatronIndexedDataset(tmp_path / "m"), 0.5)
    for lo, hi in zip(doc_index[:-1], doc_index[1:]):
        assert set(range(lo, hi)) <= set(split["train"].tolist()) or set(range(lo, hi)) <= set(
            split["validation"].tolist()
        )


def test_one_epoch_visits_every_window_once(mega_prefix):
    it = data.make_batches(make_cfg("megatron", "", mega_prefix), vocab_size=VOCAB, seq_len=SEQ, global_batch=1, seed=3)
    ds = MegatronIndexedDataset(mega_prefix)
    epoch = GPTSamples(ds, data_megatron.split_sequences(ds, 0.25)["train"], SEQ, seed=3)
    rows = sorted(it.next().tobytes() for _ in range(epoch.num_samples))
    assert rows == sorted(epoch.tokens(j).tobytes() for j in range(epoch.num_samples))


def test_megatron_corrupt_index_names_data_path(tmp_path, mega_prefix):
    cfg = data_cfg(source="megatron", path=str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match="data.path.*not found"):
        batches(cfg)
    good = (tmp_path / "corpus_text_document.idx").read_bytes()
    cases = {
        "magic": b"NOTMEGA\x00\x00" + good[9:],
        "version": good[:9] + struct.pack("<Q", 2) + good[17:],
        "dtype code": good[:17] + b"\x63" + good[18:],
        "implies": good[:-8],
    }
    for problem, raw in cases.items():
        (tmp_path / "corpus_text_document.idx").write_bytes(raw)
        with pytest.raises(ConfigError, match=f"data.path.*{problem}"):
            MegatronIndexedDataset(mega_prefix)
    (tmp_path / "corpus_text_document.idx").write_bytes(good)
    binary = (tmp_path / "corpus_text_document.bin").read_bytes()
    (tmp_path / "corpus_text_document.bin").write_bytes(binary[:-6])
    with pytest.raises(ConfigError, match="data.path.*truncated"):
        batches(data_cfg(source="megatron", path=mega_prefix))
    (tmp_path / "corpus_text_document.bin").write_bytes(binary)
    with pytest.raises(ConfigError, match="model.vocab_size"):
        data.make_batches(
            data_cfg(source="megatron", path=mega_prefix), vocab_size=50, seq_len=SEQ, global_batch=8, seed=0
        )


def test_negative_megatron_token_names_data_path(tmp_path):
    write_megatron_dataset(tmp_path / "neg", [np.array([1, -1, 2], np.int32)] * 40, np.int32)
    with pytest.raises(ConfigError, match="data.path.*negative"):
        batches(data_cfg(source="megatron", path=str(tmp_path / "neg")))

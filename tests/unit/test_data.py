"""Data pipeline: real `datasets` streaming, the bundled tokenizer, real files on disk.

The corpora here are small slices of the bundled KJV so that each test reads and tokenises a few
tens of thousands of tokens; small block/tokenizer-batch sizes make the streams cross block and
epoch boundaries within a few hundred batches.
"""

from __future__ import annotations

import gzip
import json
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers.runs import data_section, epoch_documents

from model_utils import data
from model_utils.config.presets import BUNDLED_DATASET, BUNDLED_TOKENIZER
from model_utils.data import stream as data_stream
from model_utils.data.sources import is_held_out
from model_utils.data.tokens import encode_documents

SEQ_LEN = 32
MICRO_BATCH = 2
SMALL = {"block_docs": 48, "tokenize_batch": 8}  # several blocks and tokenizer batches per epoch


@pytest.fixture(scope="module")
def tokenizer():
    return data.load_tokenizer(BUNDLED_TOKENIZER)


@pytest.fixture(scope="module")
def documents() -> list[str]:
    """240 distinct short documents (the first lines of KJV chapters) and two empty ones."""
    with gzip.open(BUNDLED_DATASET, "rt") as f:
        chapters = [json.loads(line)["text"] for line in f][:240]
    docs = ["\n".join(text.splitlines()[:3]) for text in chapters]
    assert len(set(docs)) == len(docs)
    return docs[:100] + ["", ""] + docs[100:]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, documents) -> str:
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    _write_jsonl(path, documents)
    return str(path)


def _write_jsonl(path: Path, texts: list[str], column: str = "text") -> None:
    path.write_text("".join(json.dumps({column: t, "id": i}) + "\n" for i, t in enumerate(texts)))


def _training_docs(documents: list[str]) -> list[str]:
    return [d for d in documents if d and not is_held_out(d)]


def _stream(
    corpus: str, tokenizer, text_column: str = "text", **overrides
) -> data_stream.TrainStream:
    options = {"rank": 0, "world_size": 1, "seed": 0, **SMALL, **overrides}
    source = data_section(corpus, text_column=text_column, train_batch_size=MICRO_BATCH)
    return data_stream.TrainStream(source, tokenizer, SEQ_LEN, **options)


def _documents(dataset: str, text_column: str = "text", **options):
    """helpers.runs.epoch_documents of this dataset."""
    return epoch_documents(data_section(dataset, text_column=text_column), **options)


def _validation(dataset: str, tokenizer, batch_size: int, num_batches: int) -> list:
    source = data_section(dataset, val_batch_size=batch_size)
    return data.validation_batches(source, tokenizer, SEQ_LEN, num_batches)


def _block(options: dict) -> dict:
    return {"block_docs": options["block_docs"]}


def _reference_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids through transformers' own __call__: an independent path from the pipeline's."""
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def _segments(tokens: torch.Tensor, eos: int) -> list[tuple[int, ...]]:
    """Split a token stream on EOS; the last (unterminated) piece is dropped."""
    out, current = [], []
    for token in tokens.tolist():
        if token == eos:
            out.append(tuple(current))
            current = []
        else:
            current.append(token)
    return out


def _flat(batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    return torch.cat([b["input_ids"].reshape(-1) for b in batches])


def test_packing_keeps_every_token_in_exact_windows(corpus, documents, tokenizer):
    stream = _stream(corpus, tokenizer)
    train = _training_docs(documents)
    epoch_tokens = sum(len(ids) + 1 for ids in _reference_ids(tokenizer, train))
    batches = [next(stream) for _ in range(epoch_tokens // (SEQ_LEN * MICRO_BATCH) + 5)]
    assert stream.epoch == 1  # the stream went on into a second epoch
    for batch in batches:
        assert batch["input_ids"].shape == (MICRO_BATCH, SEQ_LEN)
        assert batch["input_ids"].dtype == torch.long
        assert torch.equal(batch["labels"], batch["input_ids"])

    # The windows, concatenated, are exactly the epoch's documents + EOS in the reader's order...
    order = list(_documents(corpus, seed=0, **_block(SMALL)))
    assert sorted(order) == sorted(train)  # each training document exactly once
    expected = [
        t for ids in _reference_ids(tokenizer, order) for t in (*ids, tokenizer.eos_token_id)
    ]
    emitted = _flat(batches)
    assert emitted[:epoch_tokens].tolist() == expected
    # ...and the second epoch starts right after, in the same windows (the tail is not dropped).
    next_epoch = list(_documents(corpus, seed=0, epoch=1, **_block(SMALL)))
    first = _reference_ids(tokenizer, next_epoch[:1])[0]
    assert emitted[epoch_tokens : epoch_tokens + len(first)].tolist() == first
    assert next_epoch != order and sorted(next_epoch) == sorted(order)  # reshuffled


def test_validation_is_fixed_and_never_trained_on(corpus, documents, tokenizer):
    held_out = [d for d in documents if d and is_held_out(d)]
    assert 0 < len(held_out) < len(documents) // 5
    first = _validation(corpus, tokenizer, 2, 3)
    again = _validation(corpus, tokenizer, 2, 3)
    assert len(first) == 3 and all(b["input_ids"].shape == (2, SEQ_LEN) for b in first)
    assert all(
        torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(first, again, strict=True)
    )

    held_ids = {tuple(ids) for ids in _reference_ids(tokenizer, held_out)}
    val_segments = _segments(_flat(first), tokenizer.eos_token_id)
    assert len(val_segments) >= 2 and set(val_segments[1:]) <= held_ids  # [0] may be cut
    training = set(_documents(corpus, seed=3, **_block(SMALL)))
    assert training.isdisjoint(held_out) and training == set(_training_docs(documents))


def test_validation_split_files_are_used_when_present(tmp_path, documents, tokenizer):
    folder = tmp_path / "named_splits"
    folder.mkdir()
    docs = [d for d in documents if d]
    _write_jsonl(folder / "train.jsonl", docs[:150])
    _write_jsonl(folder / "validation.jsonl", docs[150:])
    _write_jsonl(folder / "test.jsonl", ["never read"] * 10)
    # All training-file documents are trained on (no hash hold-out when a split exists).
    assert sorted(_documents(str(folder))) == sorted(docs[:150])
    batches = _validation(str(folder), tokenizer, 1, 2)
    start = [
        t
        for ids in _reference_ids(tokenizer, docs[150:152])
        for t in (*ids, tokenizer.eos_token_id)
    ]
    assert _flat(batches).tolist() == start[: 2 * SEQ_LEN]


def test_folders_are_read_through_symbolic_links_and_broken_links_refused(tmp_path, documents):
    """Data staged with `ln -s` (a subfolder on shared storage) was silently left out, as was a
    dangling link's file: `Path.rglob` follows neither."""
    docs = [d for d in documents if d][:60]
    shared = tmp_path / "lustre" / "part2"
    shared.mkdir(parents=True)
    _write_jsonl(shared / "b.jsonl", docs[30:])
    folder = tmp_path / "corpus"
    folder.mkdir()
    _write_jsonl(folder / "a.jsonl", docs[:30])
    (folder / "part2").symlink_to(shared)
    (folder / "part2" / "loop").symlink_to(folder)  # a cycle is read once, not forever
    (folder / ".cache").mkdir()
    _write_jsonl(folder / ".cache" / "old.jsonl", ["hidden"])  # hidden folders stay ignored
    assert sorted(_documents(str(folder))) == sorted(_training_docs(docs))
    (folder / "c.jsonl").symlink_to(tmp_path / "gone.jsonl")
    with pytest.raises(ValueError) as error:
        data.check_dataset(str(folder), None)
    assert str(error.value) == (
        f"--dataset {folder}: {folder / 'c.jsonl'} is a broken symbolic link (to "
        f"{tmp_path / 'gone.jsonl'}): restore its target or remove the link"
    )


@pytest.mark.parametrize("files", [1, 4])
def test_rank_shards_are_disjoint_and_complete(tmp_path, documents, tokenizer, files):
    docs = [d for d in documents if d]
    for i in range(files):  # 1 file: every other document per rank; 4 files: 2 files per rank
        _write_jsonl(tmp_path / f"part-{i}.jsonl", docs[i::files])
    source = str(tmp_path)
    per_rank = [
        list(_documents(source, rank=r, world_size=2, seed=5, **_block(SMALL))) for r in range(2)
    ]
    assert set(per_rank[0]).isdisjoint(per_rank[1])
    assert sorted(per_rank[0] + per_rank[1]) == sorted(_training_docs(docs))
    streams = [_stream(source, tokenizer, rank=r, world_size=2, seed=5) for r in range(2)]
    assert not torch.equal(next(streams[0])["input_ids"], next(streams[1])["input_ids"])


def test_same_seed_same_batches_other_seed_other_order(corpus, tokenizer):
    a, b, c = (_stream(corpus, tokenizer, seed=s) for s in (7, 7, 8))
    first_a = _flat([next(a) for _ in range(20)])
    assert torch.equal(first_a, _flat([next(b) for _ in range(20)]))
    assert not torch.equal(first_a, _flat([next(c) for _ in range(20)]))


def test_resume_yields_the_uninterrupted_batches_without_retokenising(
    corpus, tokenizer, monkeypatch
):
    reference = _stream(corpus, tokenizer, seed=11)
    total = 700  # ~1.5 epochs: crosses tokenizer-batch, block and epoch boundaries
    states, batches = [], []
    for _ in range(total):
        states.append(reference.state_dict())
        batches.append(next(reference))

    tokenized: list[int] = []
    real_encode = encode_documents

    def counting_encode(tok, texts):
        tokenized.append(len(texts))
        return real_encode(tok, texts)

    monkeypatch.setattr(data_stream, "encode_documents", counting_encode)
    epoch_start = next(i for i, s in enumerate(states) if s["rank0"]["epoch"] == 1)
    block_start = next(i for i, s in enumerate(states) if s["rank0"]["block"] == 2)
    for k in (0, 1, 57, block_start, block_start + 1, epoch_start, epoch_start + 3, total - 40):
        resumed = _stream(corpus, tokenizer, seed=11)
        resumed.load_state_dict(states[k])
        tokenized.clear()
        assert torch.equal(next(resumed)["input_ids"], batches[k]["input_ids"]), k
        # Only the tokenizer batch holding the position (and maybe the next) was encoded again.
        assert sum(tokenized) <= 2 * SMALL["tokenize_batch"], (k, tokenized)
        rest = [next(resumed) for _ in range(min(30, total - k - 1))]
        assert torch.equal(_flat(rest), _flat(batches[k + 1 : k + 1 + len(rest)])), k
        assert resumed.batches == k + 1 + len(rest)

    # A resumed stream's own state resumes correctly too (state after a restore is valid).
    resumed = _stream(corpus, tokenizer, seed=11)
    resumed.load_state_dict(states[100])
    for _ in range(250):
        next(resumed)
    assert resumed.state_dict() == states[350]


def test_the_next_tokenizer_batch_is_encoded_while_the_steps_run(corpus, tokenizer, monkeypatch):
    """Within a block the step that needs the next tokenizer batch finds it encoded on the
    prefetch thread (the GPU measured a 100-300 ms stall every ~11 steps without it); at a
    block's start the read and its first batch stay on the consuming thread. The batches are
    those of a stream without prefetch."""
    threads: list[tuple[str, int]] = []
    real_encode = encode_documents

    def recording_encode(tok, texts):
        threads.append((threading.current_thread().name, len(texts)))
        return real_encode(tok, texts)

    monkeypatch.setattr(data_stream, "encode_documents", recording_encode)
    ahead = _stream(corpus, tokenizer, seed=5)
    batches = [next(ahead) for _ in range(120)]  # several blocks
    monkeypatch.setattr(data_stream, "encode_documents", real_encode)
    plain = _stream(corpus, tokenizer, seed=5, prefetch=False)
    assert torch.equal(_flat(batches), _flat([next(plain) for _ in range(120)]))
    assert ahead.state_dict() == plain.state_dict()
    names = [name for name, _ in threads]
    per_block = SMALL["block_docs"] // SMALL["tokenize_batch"]  # 6 tokenizer batches a block
    assert names[:per_block] == ["MainThread"] + ["tokenize_0"] * (per_block - 1)
    assert names.count("MainThread") < len(names) / 4


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_state_round_trips_through_torch_dcp(tmp_path, corpus, tokenizer):
    import torch.distributed.checkpoint as dcp

    stream = _stream(corpus, tokenizer, seed=2)
    for _ in range(123):
        next(stream)
    state = stream.state_dict()["rank0"]
    assert all(isinstance(v, int | str) for v in state.values())  # small and plain
    assert len(json.dumps(state)) < 2000
    dcp.save({"data": stream}, checkpoint_id=str(tmp_path / "ckpt"))
    expected = [next(stream)["input_ids"] for _ in range(5)]

    fresh = _stream(corpus, tokenizer, seed=2)
    dcp.load({"data": fresh}, checkpoint_id=str(tmp_path / "ckpt"))
    assert fresh.batches == 123
    assert all(torch.equal(next(fresh)["input_ids"], e) for e in expected)


def _rank_stream(corpus: str, tokenizer, rank: int, world_size: int, **overrides):
    """A rank's stream of shards, each like `_stream` (the test's small blocks), validating on
    one batch of each shard's validation part."""
    source = data_section(corpus, train_batch_size=MICRO_BATCH)
    options = {"rank": rank, "world_size": world_size, "seed": 0, **SMALL, **overrides}
    return data.RankStream(source, tokenizer, SEQ_LEN, **options)


def test_a_shard_state_from_another_shard_or_seed_is_refused(corpus, tokenizer):
    saved = []
    for rank in range(2):
        stream = _stream(corpus, tokenizer, rank=rank, world_size=2)
        for _ in range(5 + rank):
            next(stream)
        saved.append(stream.state_dict())
    assert list(saved[1]) == ["rank1"]  # one key per shard: DCP keeps every rank's position
    single = _stream(corpus, tokenizer)
    with pytest.raises(ValueError, match="no entry for rank0"):
        single.load_state_dict(saved[1])
    with pytest.raises(ValueError, match="world_size=2"):
        single.load_state_dict(saved[0])
    with pytest.raises(ValueError, match="seed=0"):
        _stream(corpus, tokenizer, rank=1, world_size=2, seed=4).load_state_dict(saved[1])


def test_a_resume_on_a_divisor_of_the_ranks_continues_every_shard_exactly(corpus, tokenizer):
    """Four ranks' positions, uneven (a rank that read more), resumed on two ranks and then on
    one: each rank reads its shards where they stopped, the one behind first; so the batches
    are those the four ranks would have read next, none skipped or read twice."""
    four = [_rank_stream(corpus, tokenizer, rank, 4) for rank in range(4)]
    for rank, stream in enumerate(four):
        for _ in range(3 + (rank == 2)):
            next(stream)
    saved = [stream.state_dict() for stream in four]
    two = [_rank_stream(corpus, tokenizer, rank, 2) for rank in range(2)]
    said = {stream.restart_after_reshard(saved) for stream in two}
    assert said == {"data stream continues each of its 4 shards where it stopped (2 a rank)"}
    # rank 0 of 2 reads shards 0 and 2; shard 2 is one batch ahead, so shard 0 comes first.
    expected = [next(four[s]) for s in (0, 0, 2, 0, 2)]
    got = [next(two[0]) for _ in range(5)]
    assert torch.equal(_flat(got), _flat(expected))
    one = _rank_stream(corpus, tokenizer, 0, 1)
    one.load_state_dict({**two[0].state_dict(), **two[1].state_dict()})  # a same-size load
    assert [shard.rank for shard in one.shards] == [0, 1, 2, 3]
    expected = [next(four[s]) for s in (1, 3, 1, 3, 1, 3, 0, 1, 2)]  # shards 1, 3 are behind
    assert torch.equal(_flat([next(one) for _ in range(9)]), _flat(expected))
    # The resumed rank saves what a same-size resume continues (every shard's own key).
    assert sorted(one.state_dict()) == ["rank0", "rank1", "rank2", "rank3"]
    # ... and validates on the four ranks' validation batches, not on a new cut's.
    assert torch.equal(_flat(one.val_batches), _flat([b for s in four for b in s.val_batches]))
    fresh = _rank_stream(corpus, tokenizer, 0, 1).val_batches  # what a new run of one reads
    assert not torch.equal(_flat(fresh), _flat(one.val_batches[:1]))


def test_a_shard_that_cannot_validate_at_a_resume_is_one_line(tmp_path, documents, tokenizer):
    """The shards a resume reads are read at the checkpoint's load, where every rank is: a
    problem in one is a DataError line naming it (on every rank: first_problem), not a
    traceback on one rank while the others wait."""
    corpus = tmp_path / "docs.jsonl"
    _write_jsonl(corpus, documents)
    saved = [_rank_stream(str(corpus), tokenizer, rank, 2).state_dict() for rank in range(2)]
    one = _rank_stream(str(corpus), tokenizer, 0, 1)
    _write_jsonl(corpus, documents[:3])  # too little left to validate on either half
    with pytest.raises(data.DataError, match=r"windows of 32 tokens in shard 0 of 2 \(a rank's"):
        one.restart_after_reshard(saved)


def test_a_resume_on_another_number_of_ranks_restarts_at_the_next_epoch(corpus, tokenizer):
    saved = []
    for rank in range(2):
        stream = _rank_stream(corpus, tokenizer, rank, 2)
        for _ in range(5 + rank):
            next(stream)
        saved.append(stream.state_dict())
    three = _rank_stream(corpus, tokenizer, 0, 3)
    with pytest.raises(ValueError, match="data state has 2 shards: not a multiple of 3"):
        three.load_state_dict(saved[0])
    said = three.restart_after_reshard(saved)  # what the checkpoint's reshard hook calls
    [shard] = three.shards
    assert (shard.rank, shard.world_size, shard.epoch, shard.batches) == (0, 3, 1, 6)
    assert said == (
        "data stream starts epoch 1, cut anew for 3 rank(s): the rest of epoch 0 is not read, and "
        "what it read comes again (a resume on a divisor of 2 ranks would have continued it "
        "exactly)"
    )
    fresh = _stream(corpus, tokenizer, rank=0, world_size=3)
    fresh.restart_at_epoch(1, 0)
    assert torch.equal(next(three)["input_ids"], next(fresh)["input_ids"])


def test_state_names_a_local_dataset_independently_of_its_path(corpus, tokenizer, monkeypatch):
    stream = _stream(corpus, tokenizer)  # absolute path
    for _ in range(3):
        next(stream)
    monkeypatch.chdir(Path(corpus).parent)
    relative = _stream(Path(corpus).name, tokenizer)
    relative.load_state_dict(stream.state_dict())
    assert torch.equal(next(relative)["input_ids"], next(stream)["input_ids"])


def test_documents_are_never_truncated_even_if_the_tokenizer_file_says_so(tmp_path, tokenizer):
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(Path(BUNDLED_TOKENIZER) / "tokenizer.json"))
    backend.enable_truncation(max_length=8)  # as some hub tokenizer.json files ship
    backend.save(str(tmp_path / "tokenizer.json"))
    config = (Path(BUNDLED_TOKENIZER) / "tokenizer_config.json").read_text()
    (tmp_path / "tokenizer_config.json").write_text(config)
    truncating = data.load_tokenizer(str(tmp_path))
    text = "In the beginning God created the heaven and the earth. " * 4
    expected = _reference_ids(tokenizer, [text])[0] + [tokenizer.eos_token_id]
    assert len(expected) > 40
    assert encode_documents(truncating, [text]).tolist() == expected


def test_vocab_mismatch_is_one_clear_line(tokenizer):
    data.check_vocab(tokenizer, len(tokenizer))
    with pytest.raises(ValueError, match="--vocab_size") as error:
        data.check_vocab(tokenizer, 1000)
    message = str(error.value)
    assert "\n" not in message
    assert f"--vocab_size {len(tokenizer)}" in message and "1000" in message


def test_bad_dataset_and_tokenizer_arguments(tmp_path, corpus, tokenizer):
    for bad in ("/no/such/file.jsonl", "./missing_dir", "data/missing.parquet"):
        with pytest.raises(ValueError, match="no such file or directory"):
            data.check_dataset(bad, None)
    (tmp_path / "notes.md").write_text("# not data")
    with pytest.raises(ValueError, match="no .* files in this folder"):
        data.check_dataset(str(tmp_path), None)
    with pytest.raises(ValueError, match="unsupported file type"):
        data.check_dataset(str(tmp_path / "notes.md"), None)
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "README.txt").write_text("about the data")
    with pytest.raises(ValueError) as mixed:  # it named neither file
        data.check_dataset(str(tmp_path), None)
    assert str(mixed.value) == (
        f"--dataset {tmp_path}: mixes file formats: json (a.jsonl), text (sub/README.txt); keep "
        "one in the folder"
    )
    with pytest.raises(ValueError, match="hub datasets only"):
        data.check_dataset(corpus, "en")
    data.check_dataset("allenai/c4", "en")  # hub names are not looked up here
    data.check_dataset(BUNDLED_DATASET, None)
    with pytest.raises(ValueError, match="no such directory"):
        data.load_tokenizer("./no_tokenizer_here")
    with pytest.raises(ValueError, match=r"tokenizer.json is a file: give the folder that holds"):
        data.load_tokenizer(f"{BUNDLED_TOKENIZER}/tokenizer.json")  # was 'Repo id must be ...'
    with pytest.raises(ValueError, match=f"--tokenizer {tmp_path} holds no tokenizer"):
        data.load_tokenizer(str(tmp_path))  # was "Couldn't instantiate the backend tokenizer"
    with pytest.raises(ValueError, match="has no column 'body'"):
        next(_stream(corpus, tokenizer, text_column="body"))
    with pytest.raises(ValueError, match="only .* windows"):
        _validation(corpus, tokenizer, 8, 1000)


def test_text_parquet_and_compressed_sources(tmp_path, documents):
    docs = [d for d in documents if d][:60]
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "book.txt").write_text("\n\n".join(docs) + "\n")
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"body": docs}), tmp_path / "pq" / "docs.parquet")
    with gzip.open(tmp_path / "docs.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    expected = sorted(_training_docs(docs))
    assert sorted(_documents(str(tmp_path / "txt"))) == expected  # one per paragraph
    with pytest.raises(ValueError) as wrong:  # its one column: the fix is to drop the flag
        list(_documents(str(tmp_path / "txt"), text_column="body"))
    assert str(wrong.value).endswith(
        "has no column 'body' (columns: text): a .txt file has only that one: drop --text_column"
    )
    assert sorted(_documents(str(tmp_path / "pq"), text_column="body")) == expected
    assert sorted(_documents(str(tmp_path / "docs.jsonl.gz"))) == expected


def test_bundled_corpus_and_tokenizer_work_offline():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(BUNDLED_TOKENIZER, local_files_only=True)
    assert len(tokenizer) == 8192 and tokenizer.eos_token == "<|endoftext|>"
    with gzip.open(BUNDLED_DATASET, "rt") as f:
        chapters = [json.loads(line)["text"] for line in f]
    assert len(chapters) == 1189 and chapters[0].startswith("Genesis 1\nIn the beginning")
    held_out = sum(is_held_out(c) for c in chapters)
    assert 0.03 < held_out / len(chapters) < 0.08  # ~5%: enough for the tiny preset's validation
    text = "In the beginning God created the heaven and the earth."
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_the_data_fingerprint_sees_a_same_size_edit_in_a_sampled_block(tmp_path) -> None:
    """Head and tail alone missed an edit in the middle that kept the size (a record fixed in
    place): the sampled blocks see one that touches them; what no block touches is the stated
    limit (docs/data.md); a fingerprint saved before the samples still matches its file."""
    from model_utils.data import checks

    corpus = tmp_path / "corpus.jsonl"
    lines = [f'{{"text": "document {i:07d} ' + "x" * 90 + '"}\n' for i in range(40_000)]
    corpus.write_text("".join(lines))
    saved = checks.data_fingerprint(str(corpus))
    size, block = corpus.stat().st_size, checks.FINGERPRINT_BYTES
    sampled = (size - block) * 8 // (checks.FINGERPRINT_SAMPLES + 1) + 100
    unsampled = sampled + block + 100  # between two sampled blocks (4 MB: gaps of ~170 KB)
    with open(corpus, "r+b") as fh:
        fh.seek(unsampled)
        fh.write(b"y")
    assert checks.data_change(saved, checks.data_fingerprint(str(corpus))) is None  # the limit
    with open(corpus, "r+b") as fh:
        fh.seek(sampled)
        fh.write(b"y")
    now = checks.data_fingerprint(str(corpus))
    assert checks.data_change(saved, now) == "corpus.jsonl changed (same size, other contents)"
    before_samples = {name: ":".join(v.split(":")[:2]) for name, v in now.items()}
    assert checks.data_change(before_samples, now) is None


def test_verify_data_full_sees_the_edit_no_sampled_block_touches(tmp_path) -> None:
    """--verify_data full: every byte is summed, so the same-size edit between the sampled
    blocks that the default check misses is refused; the resume line says which check ran."""
    from model_utils.data import checks

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(f'{{"text": "document {i:07d} {"x" * 90}"}}\n' for i in range(40_000))
    )
    sampled, full = checks.data_fingerprint(str(corpus)), checks.data_fingerprint(str(corpus), True)
    size, block = corpus.stat().st_size, checks.FINGERPRINT_BYTES
    between = (size - block) * 8 // (checks.FINGERPRINT_SAMPLES + 1) + 2 * block
    with open(corpus, "r+b") as fh:
        fh.seek(between)
        fh.write(b"y")
    assert checks.data_change(sampled, checks.data_fingerprint(str(corpus))) is None
    # Saved with the full check, resumed with the default on the same data: not a change.
    assert checks.data_change(full, sampled) is None
    now = checks.data_fingerprint(str(corpus), whole=True)
    assert checks.data_change(full, now) == "corpus.jsonl changed (same size, other contents)"
    assert checks.data_check(full, now) == "every byte of 1 file(s)"
    assert checks.data_check(sampled, sampled) == "size, ends and 16 sampled blocks of 1 file(s)"
    assert checks.data_check(sampled, now).endswith("recorded no whole-file sums; later ones do)")
    assert checks.data_check(None, now) == "none (the checkpoint recorded no fingerprint)"
    assert checks.data_check(sampled, None) == "none (a hub dataset is not fingerprinted)"


def _first_batches(extra: list[str], tokenizer, count: int = 3) -> list[torch.Tensor]:
    """The first training batches build_data gives a world of one for FAST and ``extra``."""
    from helpers.inprocess import world_of_one
    from helpers.runs import FAST

    from model_utils.config.arguments import parse_args
    from model_utils.data.build import build_data
    from model_utils.parallel.distributed import world_from_env

    world_of_one()
    stream = build_data(parse_args([*FAST, *extra]), tokenizer, world_from_env({}))
    return [next(stream)["input_ids"] for _ in range(count)]


def test_data_seed_keeps_the_data_order_across_init_seeds(tokenizer) -> None:
    """Replicas for the noise band differ in --seed alone: with one --data_seed they read the
    same tokens; without it, --seed orders the data too."""
    replica_a = _first_batches(["--seed", "1", "--data_seed", "7"], tokenizer)
    replica_b = _first_batches(["--seed", "2", "--data_seed", "7"], tokenizer)
    assert all(torch.equal(a, b) for a, b in zip(replica_a, replica_b, strict=True))
    plain = _first_batches(["--seed", "7"], tokenizer)
    assert all(torch.equal(a, b) for a, b in zip(replica_a, plain, strict=True))
    other = _first_batches(["--seed", "2"], tokenizer)
    assert not all(torch.equal(a, b) for a, b in zip(replica_a, other, strict=True))

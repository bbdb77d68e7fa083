"""Text dataset -> tokens -> packed windows -> this rank's micro-batches, with a resumable position.

The pipeline, and why it is built this way:

* Source. A Hugging Face hub dataset (streamed, never downloaded whole) or a local file/folder of
  .txt/.json/.jsonl/.parquet (optionally compressed), both read as a `datasets.IterableDataset`,
  so the bundled corpus exercises the same code path as C4. `.txt` files yield one document per
  paragraph (blank-line separated).
* Validation. The dataset's own `validation` split when it has one (hub datasets; local folders
  with files named like `validation`/`valid`/`val`/`dev`). Otherwise a fixed 5% of documents,
  chosen by a hash of the text (`is_held_out`): the same documents every run, whatever the seed,
  rank count or file order, and never in training. Exact duplicates land on the same side.
* Rank shards. `datasets.distributed.split_dataset_by_node` (whole files per rank when the file
  count divides the world size, otherwise every world_size-th document): disjoint by design.
  The cut is the launch's world size; a resume on a divisor of it reads several shards a rank.
* Order. Per epoch, the shard order is shuffled (`IterableDataset.set_epoch` with a key derived
  from seed and epoch), and documents are read in blocks of `block_docs` that are permuted with
  a generator seeded by (seed, epoch, block). Deterministic for a seed, and - unlike a datasets
  shuffle buffer, whose content is lost on resume - exactly reproducible after a restore.
* Tokens. The fast tokenizer encodes `tokenize_batch` documents per call (Rust, batched); EOS is
  appended after every document and everything is concatenated. Windows of exactly `seq_len`
  tokens are cut back to back from that stream: no token is dropped or repeated, and the stream
  carries over epoch boundaries (the tail of one epoch starts the next batch).
* Position. A shard's `state_dict()` holds a few integers and the datasets state of the current
  block's start (a JSON string): epoch, block, first document of the current tokenizer batch and
  tokens already emitted from it. Restoring re-reads one block of raw text from that state and
  re-tokenises one tokenizer batch; nothing before the block is read or tokenised again.

The modules, one job each: `sources` (naming and opening a dataset, this rank's part),
`checks` (the start-up scan of the user's files, and the one hub look-up of a dataset or
tokenizer name), `tokens` (tokenizer, encoding), `stream` (the training stream and its
position), `validation` (the fixed validation batches), `reads` (a read failing on one rank
while all ranks stop together; where the Hugging Face cache is), `build` (a run's stream and
validation batches from the data section). The names re-exported here are what a run and its
start-up checks use (`from model_utils import data; data.build_data(...)`); tests, scripts and
benchmarks that need a module's internals import that module.
"""

from model_utils.data.build import RankStream, build_data
from model_utils.data.checks import (
    check_hub_dataset,
    check_local_data,
    data_change,
    data_fingerprint,
)
from model_utils.data.reads import ReadGuard, cache_location, raise_read_failure
from model_utils.data.sources import DataError, check_dataset
from model_utils.data.tokens import check_vocab, load_tokenizer, tokenizer_fingerprint
from model_utils.data.validation import validation_batches

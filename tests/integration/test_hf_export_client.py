"""Real clients on the Hugging Face folder a run hands on (issue 30, part 3): what train.py
--export_hf and scripts/convert_checkpoint.py write must load, tokenize, generate and score with
no hand help.

A tiny run learns one short document (repeated, so that a few steps are enough for the model to
end it with the tokenizer's end-of-text), then:

- transformers, in a process of its own, loads the folder with `AutoModelForCausalLM` and
  `AutoTokenizer` (no arguments but the folder) and `generate` stops at the tokenizer's eos; the
  config's bos/eos/pad ids are the tokenizer's (transformers' defaults, 1/2, name other tokens);
- lm-eval-harness scores the folder on a rolling-loglikelihood task over a local text file, and
  its total log-likelihood equals the project's own loss on the same text, computed with the
  project's model code on the run's checkpoint;
- the converter writes the same folder from that checkpoint, which passes the same check.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.procs import PYTHON, launch_report
from helpers.runs import losses, run_train

ROOT = Path(__file__).resolve().parents[2]
#: The document the run learns, and the prompt whose greedy continuation must end it with eos.
DOCUMENT = "In the beginning God created the heaven."
PROMPT = "In the beginning God"
#: The text lm-eval scores: not the training document, shorter than one window (64 positions).
TEXT = "And the earth was without form, and void; and darkness was upon the face of the deep."
SHAPE = (
    "--preset tiny --hidden_width 64 --num_layers 2 --num_heads 4 --num_key_value_heads 2 "
    "--intermediate_size 128 --max_context_width 64 --train_batch_size 4"
    # fp32 compute: bf16 matmuls are 20-60x slower on a CPU without bf16 units (AVX2 only)
    " --bf16=0"
).split()
TRAINING = [
    *SHAPE,
    "--max_steps",
    "40",
    "--warmup",
    "2",
    "--lr",
    "5e-3",
    "--validation_batches",
    "1",
]
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

pytestmark = pytest.mark.slow

#: The client: the folder is its only argument; prints what the test checks, as JSON.
CLIENT = """
import json, sys
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, prompt = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(folder)
tokenizer = AutoTokenizer.from_pretrained(folder)
inputs = tokenizer(prompt, return_tensors="pt")
out = model.generate(**inputs, max_new_tokens=20)
config = model.config
print(json.dumps({
    "architectures": config.architectures, "use_cache": config.use_cache,
    "config": [config.bos_token_id, config.eos_token_id, config.pad_token_id],
    "generation": [model.generation_config.bos_token_id, model.generation_config.eos_token_id,
                   model.generation_config.pad_token_id],
    "tokenizer": [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id],
    "prompt_len": inputs["input_ids"].shape[1], "generated": out[0].tolist(),
    "text": tokenizer.decode(out[0], skip_special_tokens=True),
}))
"""


def write_documents(folder: Path) -> Path:
    """A local dataset of one document, repeated, in a train and a validation split."""
    folder.mkdir(parents=True)
    for split in ("train", "validation"):
        lines = [json.dumps({"text": DOCUMENT})] * 300
        (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run's folder (run/, its checkpoints, and the export hf/)."""
    root = tmp_path_factory.mktemp("client")
    data = write_documents(root / "data")
    run_train(
        *TRAINING,
        f"--dataset={data}",
        f"--output_dir={root / 'run'}",
        f"--export_hf={root / 'hf'}",
    )
    return root


def client(folder: Path) -> dict:
    """The client's report on `folder`, from a process of its own (nothing of this one)."""
    done = subprocess.run(
        [sys.executable, "-c", CLIENT, str(folder), PROMPT],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **OFFLINE},
    )
    assert done.returncode == 0, launch_report(done)
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_client(report: dict, architecture: str = "LlamaForCausalLM") -> None:
    """Loads as `architecture`, the ids are the tokenizer's, and generate ends the learnt document
    with the tokenizer's eos (before max_new_tokens) and stops there."""
    from model_utils import data
    from model_utils.config.presets import BUNDLED_TOKENIZER

    tokenizer = data.load_tokenizer(BUNDLED_TOKENIZER)
    eos = tokenizer.eos_token_id
    assert report["architectures"] == [architecture] and report["use_cache"] is True
    assert report["tokenizer"] == [tokenizer.bos_token_id, eos, None]
    assert report["config"] == report["generation"] == [tokenizer.bos_token_id, eos, eos]
    generated = report["generated"]
    assert generated[-1] == eos and eos not in generated[report["prompt_len"] : -1], generated
    assert len(generated) < report["prompt_len"] + 20
    assert report["text"] == DOCUMENT


def test_transformers_loads_the_export_and_generate_stops_at_the_tokenizers_eos(run: Path):
    check_client(client(run / "hf"))


def test_a_tiny_mistral_trains_and_its_export_generates_as_a_mistral(tmp_path: Path) -> None:
    """The second model family end to end: --preset tiny-mistral picks the row, train.py learns
    the document (the loss goes down), and the export is a MistralForCausalLM that ends it."""
    mistral = [*TRAINING, "--preset=tiny-mistral"]
    data = write_documents(tmp_path / "data")
    run_train(
        *mistral,
        f"--dataset={data}",
        f"--output_dir={tmp_path / 'run'}",
        f"--export_hf={tmp_path / 'hf'}",
    )
    steps = losses(tmp_path / "run")
    assert steps[max(steps)] < steps[min(steps)] / 2, steps
    check_client(client(tmp_path / "hf"), "MistralForCausalLM")


def test_the_converter_writes_the_same_complete_folder(run: Path) -> None:
    """From the run's checkpoint, with the tokenizer its marker records: every file --export_hf
    wrote, the same bytes (the weights are the same: the last checkpoint is the final model)."""
    out = run / "converted"
    cmd = [PYTHON, str(ROOT / "scripts" / "convert_checkpoint.py")]
    done = subprocess.run(
        [*cmd, str(run / "run" / "checkpoints"), str(out)], capture_output=True, text=True
    )
    assert done.returncode == 0, launch_report(done)
    exported = sorted(p.name for p in (run / "hf").iterdir())
    assert sorted(p.name for p in out.iterdir()) == exported
    assert {"tokenizer.json", "generation_config.json", "config.json"} <= set(exported)
    for name in exported:
        assert (out / name).read_bytes() == (run / "hf" / name).read_bytes(), name
    check_client(client(out))


TASK = """task: export_text
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


def lm_eval_log_likelihood(folder: Path, work: Path) -> float:
    """lm-eval-harness's total log-likelihood of TEXT under the model in `folder` (its `lm_eval`
    command, offline, on CPU), recovered from its bits_per_byte: -ll / (bytes * ln 2)."""
    work.mkdir()
    (work / "text.jsonl").write_text(json.dumps({"text": TEXT}) + "\n")
    (work / "tasks").mkdir()
    (work / "tasks" / "export_text.yaml").write_text(TASK.format(data=work / "text.jsonl"))
    cmd = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args"]
    cmd += [f"pretrained={folder}", "--tasks", "export_text", "--include_path", str(work / "tasks")]
    cmd += ["--device", "cpu", "--batch_size", "1", "--output_path", str(work / "out")]
    env = {**os.environ, **OFFLINE, "HF_DATASETS_CACHE": str(work / "datasets")}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=work)
    assert done.returncode == 0, launch_report(done)
    [results] = (work / "out").rglob("results_*.json")
    bits_per_byte = json.loads(results.read_text())["results"]["export_text"]["bits_per_byte,none"]
    return -bits_per_byte * len(TEXT.encode("utf-8")) * math.log(2)


def project_log_likelihood(checkpoint: Path) -> float:
    """The project's own loss on TEXT: its model code (modeling.build, with the chunked loss
    the run trained with) holding the checkpoint's weights, in fp32, on the tokens the data
    pipeline makes (encode_documents: the text, then eos), each predicted after the eos that
    precedes every document in training, times the number of tokens predicted."""
    from model_utils import data
    from model_utils.checkpoint.layout import iter_dcp_model_layers
    from model_utils.config import arguments
    from model_utils.data.tokens import encode_documents
    from model_utils.model import modeling

    args = arguments.parse_args(TRAINING)
    model = modeling.build(args, "hf", torch.device("cpu"))
    modeling.materialize(model, torch.device("cpu"), seed=args.run.seed)
    weights = {name: t for layer in iter_dcp_model_layers(checkpoint) for name, t in layer.items()}
    model.load_state_dict(weights, strict=True)
    tokenizer = data.load_tokenizer(args.data.tokenizer)
    tokens = encode_documents(tokenizer, [TEXT]).tolist()  # the text, then its eos
    ids = torch.tensor([[tokenizer.eos_token_id, *tokens[:-1]]])
    assert ids.shape[1] <= args.model.max_context_width
    with torch.no_grad():
        loss = model.eval()(input_ids=ids, labels=ids).loss
    return -float(loss) * (ids.shape[1] - 1)


def test_lm_eval_scores_the_export_as_the_projects_own_loss(run: Path, tmp_path: Path) -> None:
    from model_utils.checkpoint.manifest import latest_checkpoint

    expected = project_log_likelihood(latest_checkpoint(run / "run" / "checkpoints"))
    scored = lm_eval_log_likelihood(run / "hf", tmp_path / "lm_eval")
    assert scored == pytest.approx(expected, rel=1e-4, abs=0)

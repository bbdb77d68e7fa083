"""`--init_from_hf DIR`: the model is the one DIR/config.json describes.

Checkpoints saved by transformers itself (random weights, small versions of the Llama 2, 3, 3.1
and 3.2 families: MHA and GQA, RoPE bases, llama3 RoPE scaling, RMSNorm epsilon, tied
embeddings) are loaded by train.py's own builder in both implementations (hf, and te on the TE
double); the loss and logits equal transformers' LlamaForCausalLM on the same folder. A preset or
flag that contradicts the config is refused in one line naming both values.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from model_utils.config.arguments import UsageError, parse_args

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(
    vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=None
)
# The families' features at a size a CPU test can run. RoPE scaling keeps the families'
# factors with a short original context, so it changes the frequencies that 32 tokens use.
FAMILIES = {
    "llama2": dict(num_attention_heads=4, num_key_value_heads=4, rope_theta=10000.0),
    "llama3": dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0),
    "llama3.1": dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        ),
        rope_theta=500000.0,
        max_position_embeddings=131072,
    ),
    "llama3.2": dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_scaling=dict(
            rope_type="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        ),
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
    ),
}


def hf_config(**fields):
    """A LlamaConfig as transformers writes it (rope_scaling given the 4.x way, which
    transformers 5 turns into rope_parameters)."""
    from transformers import LlamaConfig

    fields = dict(fields)
    scaling = fields.pop("rope_scaling", None)
    theta = fields.pop("rope_theta")
    rope = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
    return LlamaConfig(**fields, rope_parameters=rope)


def save_hf_model(folder: Path, family: str, seed: int = 0) -> Path:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    config = hf_config(**SMALL, **FAMILIES[family])
    LlamaForCausalLM(config).save_pretrained(str(folder))
    return folder


def save_config_only(folder: Path, **fields) -> Path:
    hf_config(**fields).save_pretrained(str(folder))
    return folder


def world_of_one() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def our_model(folder: Path, impl: str, *flags: str):
    """train.py's model (built, sharded, loaded from `folder`), its optimizer, schedule,
    backend and config: fp32."""
    import train
    from model_utils import optim
    from model_utils.parallel import distributed
    from model_utils.precision import backends as precision

    args = parse_args(
        [f"--init_from_hf={folder}", f"--model_impl={impl}", "--fp8=0", "--bf16=0"]
        + ["--max_context_width=32", "--train_batch_size=2", "--max_steps=4", "--warmup=1"]
        + list(flags)
    )
    world_of_one()
    device = torch.device("cpu")
    mesh = distributed.build_mesh(distributed.world_from_env({}), device, "full")
    backend = precision.build_backend(args, device)
    model = train.build_model(args, mesh, device, backend)
    optimizer, scheduler = optim.from_config(model, args.optim, args.run.max_steps)
    return model, optimizer, scheduler, backend, args


def one_step(model, optimizer, scheduler, backend, args, ids: torch.Tensor) -> float:
    from model_utils.run.step import StepParts, train_step

    batch = ({"input_ids": ids, "labels": ids}, 1.0)
    parts = StepParts(model, optimizer, scheduler, backend, args, torch.device("cpu"))
    done = train_step(parts, lambda: batch)
    return done.loss.item()


def our_loss_and_logits(folder: Path, impl: str, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    """train.py's model loaded from `folder`: its logits, then its step-1 loss."""
    model, optimizer, scheduler, backend, args = our_model(folder, impl)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    return one_step(model, optimizer, scheduler, backend, args, ids), logits


def transformers_loss_and_logits(folder: Path, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(
        str(folder), attn_implementation="eager", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    return out.loss.item(), out.logits


@pytest.mark.parametrize("impl", ["hf", "te"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_loaded_model_computes_what_transformers_computes(
    family: str, impl: str, tmp_path, te_double
) -> None:
    folder = save_hf_model(tmp_path / family, family)
    ids = torch.randint(0, 8192, (2, 32), generator=torch.Generator().manual_seed(7))
    want_loss, want_logits = transformers_loss_and_logits(folder, ids)
    got_loss, got_logits = our_loss_and_logits(folder, impl, ids)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)
    assert got_loss == pytest.approx(want_loss, rel=1e-5)


@pytest.mark.parametrize("impl", ["hf", "te"])
def test_a_tied_checkpoint_trains_as_one_matrix(impl: str, tmp_path, te_double) -> None:
    """Llama 3.2's tied embedding is one parameter through embedding and lm_head: counted
    once, stepped once by AdamW, and still one tensor after training."""
    folder = save_hf_model(tmp_path / "tied", "llama3.2")
    model, optimizer, scheduler, backend, args = our_model(folder, impl)
    assert args.model.tie_word_embeddings
    head, embedding = model.lm_head.weight, model.model.embed_tokens.weight
    assert head is embedding
    listed = [p for group in optimizer.param_groups for p in group["params"]]
    assert sum(p is head for p in listed) == 1
    start = head.detach().clone()
    ids = torch.randint(0, 8192, (2, 32), generator=torch.Generator().manual_seed(7))
    losses = [one_step(model, optimizer, scheduler, backend, args, ids) for _ in range(3)]
    assert losses[-1] < losses[0]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not torch.equal(model.lm_head.weight.detach(), start)
    # The export is the same kind of model: config tied, one tensor, the same logits.
    import json

    from safetensors import safe_open
    from transformers import LlamaForCausalLM

    from model_utils import checkpoint, data
    from model_utils.config.presets import BUNDLED_TOKENIZER

    out = tmp_path / "export"
    checkpoint.export_hf(model, model.config, out, data.load_tokenizer(BUNDLED_TOKENIZER))
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    with safe_open(str(out / "model.safetensors"), framework="pt") as stored:
        assert "lm_head.weight" not in stored.keys()
    with torch.no_grad():
        ours = model(input_ids=ids).logits.float()
    reloaded = LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, ours, rtol=1e-4, atol=1e-4)


TIED_VARIANTS = {
    "fp8": ("--bf16=1", "--fp8=1"),
    "fp32-masters": ("--bf16=1", "--master_weights=optimizer"),
    "8bit-moments": ("--optimizer=adamw8bit",),
}


@pytest.mark.parametrize("variant", sorted(TIED_VARIANTS))
@pytest.mark.parametrize("impl", ["hf", "te"])
def test_tied_stays_one_matrix_in_every_precision_and_optimizer(
    impl: str, variant: str, tmp_path, te_double
) -> None:
    """FP8 (lm_head and the embedding stay high precision), fp32 masters in the optimizer
    (one master for the one matrix; the export writes it once) and 8-bit moments."""
    from model_utils import checkpoint, data
    from model_utils.config.presets import BUNDLED_TOKENIZER
    from model_utils.precision import master_weights

    folder = save_hf_model(tmp_path / "tied", "llama3.2")
    model, optimizer, scheduler, backend, args = our_model(folder, impl, *TIED_VARIANTS[variant])
    ids = torch.randint(0, 8192, (2, 32), generator=torch.Generator().manual_seed(7))
    losses = [one_step(model, optimizer, scheduler, backend, args, ids) for _ in range(3)]
    assert losses[-1] < losses[0]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    masters = master_weights.masters_by_name(model, optimizer)
    if variant != "fp32-masters":
        return
    assert [n for n in masters if "embed" in n or "lm_head" in n] == ["model.embed_tokens.weight"]
    out = tmp_path / "export"
    tokenizer = data.load_tokenizer(BUNDLED_TOKENIZER)
    checkpoint.export_hf(model, model.config, out, tokenizer, masters=masters)
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as stored:
        assert "lm_head.weight" not in stored.keys()
        exported = stored.get_tensor("model.embed_tokens.weight")
    assert torch.equal(exported, masters["model.embed_tokens.weight"].full_tensor())


def test_an_untied_flag_on_a_tied_checkpoint_is_refused(tmp_path) -> None:
    folder = save_config_only(tmp_path, **SMALL, **FAMILIES["llama3.2"])
    with pytest.raises(UsageError) as refused:
        parse_args([f"--init_from_hf={folder}", "--tie_word_embeddings=0"])
    assert "its config.json has tie_word_embeddings True, but --tie_word_embeddings False" in (
        str(refused.value)
    )


def test_rope_scaling_is_visible_at_this_size(tmp_path) -> None:
    """The families' tests could not tell a dropped RoPE scaling: the same weights read without
    it give other logits."""
    import json

    folder = save_hf_model(tmp_path / "scaled", "llama3.2")
    ids = torch.randint(0, 8192, (1, 32), generator=torch.Generator().manual_seed(7))
    _, scaled = transformers_loss_and_logits(folder, ids)
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_scaling", None)
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    (folder / "config.json").write_text(json.dumps(config))
    _, plain = transformers_loss_and_logits(folder, ids)
    assert (scaled - plain).abs().max() > 1e-3


def test_the_runs_default_folder_is_named_after_the_model_it_starts_from(tmp_path) -> None:
    folder = save_config_only(tmp_path / "Llama-3.2-1B", **SMALL, **FAMILIES["llama3.2"])
    assert parse_args([f"--init_from_hf={folder}/", "--fp8=0"]).run.output_dir == (
        "runs/Llama-3.2-1B-bf16"
    )
    given = parse_args([f"--init_from_hf={folder}", "--output_dir=runs/mine"]).run.output_dir
    assert given == "runs/mine"
    assert parse_args(["--preset=tiny", "--fp8=0"]).run.output_dir == "runs/tiny-bf16"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_run_takes_every_model_field_from_config_json(family: str, tmp_path) -> None:
    folder = save_config_only(tmp_path, **SMALL, **FAMILIES[family])
    args = parse_args([f"--init_from_hf={folder}", "--fp8=0"])
    spec = FAMILIES[family]
    assert (
        args.model.hidden_width,
        args.model.num_layers,
        args.model.intermediate_size,
        args.model.vocab_size,
    ) == (
        64,
        2,
        128,
        8192,
    )
    assert (args.model.num_heads, args.model.num_key_value_heads) == (
        spec["num_attention_heads"],
        spec["num_key_value_heads"],
    )
    assert args.model.rope_theta == spec["rope_theta"]
    assert args.model.rope_scaling == spec.get("rope_scaling")
    assert args.model.rms_norm_eps == spec.get("rms_norm_eps", 1e-6)  # transformers' default
    assert args.model.max_position_embeddings == spec.get("max_position_embeddings", 2048)
    assert args.model.tie_word_embeddings == spec.get("tie_word_embeddings", False)


LLAMA31_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=131072,
)
SCALING = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)


@pytest.mark.parametrize(
    ("config", "flags", "said"),
    [
        pytest.param(
            dict(LLAMA31_8B, rope_scaling=dict(SCALING, factor=32.0)),
            ["--preset=llama3.1-8b"],
            "its config.json has rope_scaling.factor 32.0, but --preset llama3.1-8b "
            "(rope_scaling.factor 8.0) says otherwise",
            id="llama3.2-scaling-under-llama3.1-preset",
        ),
        pytest.param(
            dict(LLAMA31_8B, rope_scaling=SCALING),
            ["--preset=llama3-8b"],
            "its config.json has rope_scaling {'factor': 8.0, 'high_freq_factor': 4.0, "
            "'low_freq_factor': 1.0, 'original_max_position_embeddings': 8192, 'rope_type': "
            "'llama3'}, but --preset llama3-8b (rope_scaling None) says otherwise",
            id="llama3.1-under-a-preset-without-scaling",
        ),
        pytest.param(
            dict(SMALL, **FAMILIES["llama3"], rms_norm_eps=1e-6),
            ["--preset=tiny"],
            "its config.json has hidden_size 64, but --preset tiny (hidden_width 256) says "
            "otherwise",
            id="explicit-preset-of-another-shape",
        ),
        pytest.param(
            dict(LLAMA31_8B, rope_scaling=SCALING, rms_norm_eps=1e-6),
            ["--preset=llama3.1-8b"],
            "its config.json has rms_norm_eps 1e-06, but --preset llama3.1-8b (rms_norm_eps 1e-05)",
            id="eps",
        ),
        pytest.param(
            dict(SMALL, **FAMILIES["llama3"]),
            ["--num_layers=4"],
            "its config.json has num_hidden_layers 2, but --num_layers 4 says otherwise",
            id="explicit-flag",
        ),
    ],
)
def test_a_contradicting_preset_or_flag_is_refused_naming_both(
    config: dict, flags: list[str], said: str, tmp_path
) -> None:
    folder = save_config_only(tmp_path, **config)
    with pytest.raises(UsageError) as refused:
        parse_args([f"--init_from_hf={folder}", "--fp8=0", *flags])
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"--init_from_hf {folder}: ")
    assert said in message, message


def test_a_matching_preset_is_accepted(tmp_path) -> None:
    folder = save_config_only(tmp_path, **LLAMA31_8B, rope_scaling=SCALING)
    args = parse_args([f"--init_from_hf={folder}", "--preset=llama3.1-8b", "--fp8=0"])
    assert args.model.rope_scaling["factor"] == 8.0 and args.model.num_layers == 32


def test_a_folder_without_config_json_is_refused(tmp_path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(UsageError, match="has no config.json: the model's architecture"):
        parse_args([f"--init_from_hf={tmp_path}"])


def test_a_file_that_is_no_model_is_named_as_typed(tmp_path) -> None:
    """A text file given as the model: the refusal names that file, not its folder."""
    notes = tmp_path / "notes.txt"
    notes.write_text("not a model")
    (tmp_path / "config.json").write_text("{}")  # a folder that would pass, to name the file
    with pytest.raises(UsageError) as refused:
        parse_args([f"--init_from_hf={notes}"])
    assert str(refused.value).startswith(f"--init_from_hf: {notes} is a file, not a Hugging")


def test_a_config_json_missing_shape_fields_is_refused_naming_them(tmp_path) -> None:
    """transformers fills a missing hidden_size with its own 4096: the refusal then spoke of a
    value the file never held. Now it names the missing fields."""
    import json

    folder = save_config_only(tmp_path, **SMALL, **FAMILIES["llama3"])
    raw = json.loads((folder / "config.json").read_text())
    for key in ("hidden_size", "vocab_size", "num_key_value_heads"):
        del raw[key]
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UsageError) as refused:
        parse_args([f"--init_from_hf={folder}", "--fp8=0"])
    message = str(refused.value)
    assert "\n" not in message and "4096" not in message
    assert f"{folder / 'config.json'} has no hidden_size, vocab_size: " in message


def test_the_checkpoints_tokenizer_is_the_default(tmp_path) -> None:
    """A HF folder with tokenizer files is the run's tokenizer unless --tokenizer is given."""
    import shutil

    folder = save_config_only(tmp_path / "m", **SMALL, **FAMILIES["llama3"])
    assert parse_args([f"--init_from_hf={folder}"]).data.tokenizer != str(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "data" / "tokenizer" / name, folder / name)
    assert parse_args([f"--init_from_hf={folder}"]).data.tokenizer == str(folder)
    given = str(ROOT / "data" / "tokenizer")
    assert parse_args([f"--init_from_hf={folder}", f"--tokenizer={given}"]).data.tokenizer == given

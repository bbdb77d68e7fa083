"""A model family is a row (model_utils/config/families.py): Mistral, the second row, trains
and round-trips through Hugging Face on every model implementation (te and te_linear through
the TE double), and what a row does not build is refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from model_utils.config.arguments import UsageError, parse_args

# A Mistral at a CPU test's size, without the sliding window (the decoder Llama's is).
TINY_MISTRAL = dict(
    vocab_size=8192,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    sliding_window=None,
)


def save_mistral(folder: Path, **overrides) -> Path:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    MistralForCausalLM(MistralConfig(**{**TINY_MISTRAL, **overrides})).save_pretrained(folder)
    return folder


def our_model(folder: Path, impl: str):
    """train.py's model (built, sharded, loaded from `folder`), optimizer, schedule, backend
    and config, in fp32."""
    import train
    from model_utils import optim
    from model_utils.parallel import distributed
    from model_utils.precision import backends as precision

    args = parse_args(
        [f"--init_from_hf={folder}", f"--model_impl={impl}", "--fp8=0", "--bf16=0"]
        + ["--max_context_width=32", "--train_batch_size=2", "--max_steps=8", "--warmup=1"]
    )
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    device = torch.device("cpu")
    mesh = distributed.build_mesh(distributed.world_from_env({}), device, "full")
    backend = precision.build_backend(args, device)
    model = train.build_model(args, mesh, device, backend)
    optimizer, scheduler = optim.from_config(model, args.optim, args.run.max_steps)
    return model, optimizer, scheduler, backend, args


def train_steps(model, optimizer, scheduler, backend, args, ids, steps: int) -> list[float]:
    from model_utils.run.step import StepParts, train_step

    parts = StepParts(model, optimizer, scheduler, backend, args, torch.device("cpu"))
    batch = ({"input_ids": ids, "labels": ids}, 1.0)
    return [train_step(parts, lambda: batch).loss.item() for _ in range(steps)]


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@pytest.mark.parametrize("impl", ["hf", "te", "te_linear"])
def test_a_tiny_mistral_trains_and_round_trips_through_hugging_face(
    impl: str, tmp_path, te_double
) -> None:
    from transformers import AutoModelForCausalLM, MistralForCausalLM

    from model_utils import checkpoint, data
    from model_utils.config.presets import BUNDLED_TOKENIZER

    start = save_mistral(tmp_path / "start")
    model, optimizer, scheduler, backend, args = our_model(start, impl)
    assert args.model.model_family == "mistral"
    ids = torch.randint(0, 8192, (2, 32), generator=torch.Generator().manual_seed(7))
    reference = MistralForCausalLM.from_pretrained(str(start), dtype=torch.float32).eval()
    torch.testing.assert_close(logits(model, ids), logits(reference, ids), rtol=1e-4, atol=1e-4)
    losses = train_steps(model, optimizer, scheduler, backend, args, ids, steps=4)
    assert losses[-1] < losses[0], losses
    tokenizer = data.load_tokenizer(BUNDLED_TOKENIZER)
    checkpoint.export_hf(model, model.config, tmp_path / "out", tokenizer)
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    assert type(exported) is MistralForCausalLM
    model.eval()
    torch.testing.assert_close(logits(exported.eval(), ids), logits(model, ids))


def test_the_preset_picks_the_family_for_the_build_flops_and_sharding() -> None:
    from transformers import MistralForCausalLM

    from model_utils.model import modeling
    from model_utils.parallel import distributed
    from model_utils.report.metrics import flops

    mistral = parse_args(["--preset=tiny-mistral", "--fp8=0", "--model_impl=hf"])
    llama = parse_args(["--preset=tiny", "--fp8=0", "--model_impl=hf"])
    model = modeling.build(mistral, "hf", torch.device("cpu"))
    assert type(model) is MistralForCausalLM and model.config.sliding_window is None
    layers = distributed.decoder_layers(model)  # the row's decoder_path, of its layer class
    assert len(layers) == mistral.model.num_layers
    assert {type(layer).__name__ for layer in layers} == {"MistralDecoderLayer"}
    assert model.config.head_dim == mistral.model.head_dim  # not MistralConfig's default 128
    same_shape = flops.flops_per_token(llama.model, 256)
    assert flops.flops_per_token(mistral.model, 256) == same_shape


@pytest.mark.parametrize("impl", ["hf", "te", "te_linear"])
def test_a_sliding_window_is_refused_in_one_line(impl: str, tmp_path, capsys, te_double) -> None:
    """ModelShape states no window, so every impl would train a windowless model: train.py
    refuses config.json's window before anything runs (exit 2, one line); the TE layer names it
    too if handed one."""
    from transformers import MistralConfig

    import te_llama
    import train

    folder = save_mistral(tmp_path / "windowed", sliding_window=16)
    capsys.readouterr()  # save_pretrained's progress bar
    with pytest.raises(SystemExit) as exited:
        train.main([f"--init_from_hf={folder}", f"--model_impl={impl}", "--fp8=0"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1, err
    assert "config.json has sliding_window 16; this recipe's mistral has sliding_window None" in err
    windowed = MistralConfig(**{**TINY_MISTRAL, "sliding_window": 16})
    with pytest.raises(ValueError, match="sliding_window=16"):
        te_llama.build_te_llama(windowed, impl="te")


def test_a_preset_of_another_family_than_config_json_is_refused(tmp_path) -> None:
    """`tiny`'s shape exactly, in a Mistral: only the family contradicts the preset."""
    tiny = dict(hidden_size=256, num_hidden_layers=4, intermediate_size=688, head_dim=64)
    folder = save_mistral(tmp_path / "mistral", **tiny, rms_norm_eps=1e-5)
    with pytest.raises(UsageError, match="model_type mistral.*--preset tiny"):
        parse_args([f"--init_from_hf={folder}", "--preset=tiny", "--fp8=0"])


def test_a_model_type_without_a_row_is_refused(tmp_path) -> None:
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(UsageError, match="'gpt2' model; this recipe trains the model_types"):
        parse_args([f"--init_from_hf={tmp_path / 'gpt2'}", "--fp8=0"])


def test_a_te_mistral_checkpoint_converts_to_a_hugging_face_mistral(tmp_path, te_double) -> None:
    """scripts/convert_checkpoint.py reads the family from the checkpoint's model config: the
    fused te layout goes back to Mistral's names through the row's key map."""
    from transformers import AutoModelForCausalLM, MistralForCausalLM

    from model_utils import data
    from model_utils.checkpoint import checkpointer as ck
    from model_utils.config.presets import BUNDLED_TOKENIZER
    from scripts import convert_checkpoint

    model = our_model(save_mistral(tmp_path / "start"), "te")[0]
    fingerprint = data.tokenizer_fingerprint(data.load_tokenizer(BUNDLED_TOKENIZER))
    run = {"tokenizer": BUNDLED_TOKENIZER, "tokenizer_sha256": fingerprint, "model_impl": "te"}
    saved = ck.Checkpointer(tmp_path / "ckpt").save(1, ck.TrainState(model, config=run))
    assert convert_checkpoint.main([str(saved), str(tmp_path / "hf")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    assert type(exported) is MistralForCausalLM
    ids = torch.randint(0, 8192, (2, 32), generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(logits(exported.eval(), ids), logits(model.eval(), ids))
